// Upstream's spellings of the option enums and the boolean parser (utils/dataclasses.h).
#include "accelerate/utils/dataclasses.h"

#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

// ---- DistributedType ------------------------------------------------------------------------

TEST(DistributedType, SpellingsAreUpstreams) {
  EXPECT_EQ(to_string(DistributedType::kNo), "NO");
  EXPECT_EQ(to_string(DistributedType::kMultiCpu), "MULTI_CPU");
  EXPECT_EQ(to_string(DistributedType::kMultiGpu), "MULTI_GPU");
  EXPECT_EQ(to_string(DistributedType::kFsdp), "FSDP");
}

TEST(DistributedType, EveryValueRoundTripsThroughItsSpelling) {
  for (auto type : {DistributedType::kNo, DistributedType::kMultiCpu, DistributedType::kMultiGpu, DistributedType::kFsdp}) {
    EXPECT_EQ(parse_distributed_type(to_string(type)), type) << to_string(type);
  }
}

TEST(DistributedType, DeepSpeedIsRefusedAsUnsupported) {
  EXPECT_THROWS_WITH(parse_distributed_type("DEEPSPEED"), "got 'DEEPSPEED'");
  EXPECT_THROWS_WITH(parse_distributed_type("DEEPSPEED"), "not supported");
}

TEST(DistributedType, OtherUpstreamTypesAndHostileTextAreRefused) {
  for (const char* text : {"fsdp", "XLA", "MEGATRON_LM", "", "multi cpu", "MULTI_CPU ", "NO\n"}) {
    EXPECT_THROWS_WITH(parse_distributed_type(text), "expected one of NO, MULTI_CPU, MULTI_GPU, FSDP") << text;
  }
}

TEST(DistributedType, TheErrorIsAValueError) {
  EXPECT_THROW(parse_distributed_type("XLA"), c10::ValueError);
}

// ---- PrecisionType --------------------------------------------------------------------------

TEST(PrecisionType, SpellingsAreUpstreams) {
  EXPECT_EQ(to_string(PrecisionType::kNo), "no");
  EXPECT_EQ(to_string(PrecisionType::kFp16), "fp16");
  EXPECT_EQ(to_string(PrecisionType::kBf16), "bf16");
}

TEST(PrecisionType, EveryValueRoundTripsThroughItsSpelling) {
  for (auto precision : {PrecisionType::kNo, PrecisionType::kFp16, PrecisionType::kBf16}) {
    EXPECT_EQ(parse_precision_type(to_string(precision)), precision) << to_string(precision);
  }
}

TEST(PrecisionType, CaseDoesNotMatter) {
  EXPECT_EQ(parse_precision_type("BF16"), PrecisionType::kBf16);
  EXPECT_EQ(parse_precision_type("Fp16"), PrecisionType::kFp16);
  EXPECT_EQ(parse_precision_type("NO"), PrecisionType::kNo);
}

TEST(PrecisionType, Fp8IsRefusedAsUnsupported) {
  EXPECT_THROWS_WITH(parse_precision_type("fp8"), "fp8 mixed precision is not supported");
  EXPECT_THROWS_WITH(parse_precision_type("FP8"), "not supported");
  EXPECT_THROW(parse_precision_type("fp8"), c10::ValueError);
}

TEST(PrecisionType, UnknownPrecisionsAreRefusedByName) {
  for (const char* text : {"fp32", "half", "bf16 ", "16", "yes"}) {
    EXPECT_THROWS_WITH(parse_precision_type(text), std::string("got '") + text + "'") << text;
  }
}

// ---- str_to_bool ----------------------------------------------------------------------------

TEST(StrToBool, TrueSpellingsInAnyCase) {
  for (const char* text : {"1", "true", "True", "TRUE", "yes", "Yes", "y", "Y", "on", "ON", "t", "T"}) {
    EXPECT_TRUE(str_to_bool(text)) << text;
  }
}

TEST(StrToBool, FalseSpellingsInAnyCase) {
  for (const char* text : {"0", "false", "False", "FALSE", "no", "No", "n", "N", "off", "OFF", "f", "F"}) {
    EXPECT_FALSE(str_to_bool(text)) << text;
  }
}

TEST(StrToBool, AnythingElseIsRefusedNamingTheText) {
  for (const char* text : {"", "2", "-1", "maybe", "truee", " true", "nope"}) {
    EXPECT_THROWS_WITH(str_to_bool(text), std::string("got '") + text + "'") << '"' << text << '"';
  }
  EXPECT_THROW(str_to_bool("maybe"), c10::ValueError);
}

// ---- LoggerType, ComputeEnvironment --------------------------------------------------------------

TEST(LoggerTypeEnum, SpellsUpstreamsValuesAndRefusesOthers) {
  const std::vector<std::pair<LoggerType, std::string>> expected = {
      {LoggerType::kAll, "all"},         {LoggerType::kAim, "aim"},         {LoggerType::kTensorboard, "tensorboard"},
      {LoggerType::kWandb, "wandb"},     {LoggerType::kTrackio, "trackio"}, {LoggerType::kCometMl, "comet_ml"},
      {LoggerType::kMlflow, "mlflow"},   {LoggerType::kClearml, "clearml"}, {LoggerType::kDvclive, "dvclive"},
      {LoggerType::kSwanlab, "swanlab"}};
  for (const auto& [type, text] : expected) {
    EXPECT_EQ(to_string(type), text);
    EXPECT_EQ(parse_logger_type(text), type);
  }
  EXPECT_THROWS_WITH(parse_logger_type("TensorBoard"), "'TensorBoard' is not a valid LoggerType");
  EXPECT_THROWS_WITH(parse_logger_type("jsonl"), "'jsonl' is not a valid LoggerType");
}

TEST(ComputeEnvironmentEnum, SpellsUpstreamsValuesAndRefusesOthers) {
  EXPECT_EQ(to_string(ComputeEnvironment::kLocalMachine), "LOCAL_MACHINE");
  EXPECT_EQ(to_string(ComputeEnvironment::kAmazonSagemaker), "AMAZON_SAGEMAKER");
  EXPECT_EQ(parse_compute_environment("LOCAL_MACHINE"), ComputeEnvironment::kLocalMachine);
  EXPECT_EQ(parse_compute_environment("AMAZON_SAGEMAKER"), ComputeEnvironment::kAmazonSagemaker);
  EXPECT_THROWS_WITH(parse_compute_environment("local_machine"), "'local_machine' is not a valid ComputeEnvironment");
}

// ---- KwargsHandler::to_kwargs ---------------------------------------------------------------------

static_assert(KwargsHandler<GradScalerKwargs> && KwargsHandler<DistributedDataParallelKwargs> &&
              KwargsHandler<InitProcessGroupKwargs> && KwargsHandler<AutocastKwargs> &&
              KwargsHandler<GradientAccumulationPlugin>);
static_assert(!KwargsHandler<ProjectConfiguration>);

TEST(KwargsHandlerToKwargs, DefaultsGiveNothing) {
  EXPECT_EQ(GradScalerKwargs{}.to_kwargs(), nlohmann::ordered_json::object());
  EXPECT_EQ(DistributedDataParallelKwargs{}.to_kwargs(), nlohmann::ordered_json::object());
  EXPECT_EQ(InitProcessGroupKwargs{}.to_kwargs(), nlohmann::ordered_json::object());
  EXPECT_EQ(AutocastKwargs{}.to_kwargs(), nlohmann::ordered_json::object());
  EXPECT_EQ(GradientAccumulationPlugin{}.to_kwargs(), nlohmann::ordered_json::object());
}

TEST(KwargsHandlerToKwargs, OnlyTheChangedFieldsInDeclarationOrder) {
  const auto scaler = GradScalerKwargs{.init_scale = 1024, .growth_interval = 10}.to_kwargs();
  EXPECT_EQ(scaler.dump(), R"({"init_scale":1024.0,"growth_interval":10})");
  // A value set to its default is no change.
  const auto unchanged = GradScalerKwargs{.growth_factor = 2.0, .enabled = false}.to_kwargs();
  EXPECT_EQ(unchanged.dump(), R"({"enabled":false})");
  const auto ddp = DistributedDataParallelKwargs{.bucket_cap_mb = 15, .find_unused_parameters = true}.to_kwargs();
  EXPECT_EQ(ddp.dump(), R"({"bucket_cap_mb":15,"find_unused_parameters":true})");
  const auto group = InitProcessGroupKwargs{.backend = "gloo", .timeout = std::chrono::seconds(90)}.to_kwargs();
  EXPECT_EQ(group.dump(), R"({"backend":"gloo","timeout":90.0})");
  EXPECT_EQ(AutocastKwargs{.cache_enabled = false}.to_kwargs().dump(), R"({"cache_enabled":false})");
  EXPECT_EQ(GradientAccumulationPlugin{.num_steps = 4}.to_kwargs().dump(), R"({"num_steps":4})");
}

TEST(KwargsHandlerToKwargs, TheCommunicationHookIsNotAnArgumentOfDdp) {
  // As upstream: the hook is registered separately, not passed to DDP's constructor.
  EXPECT_EQ(DistributedDataParallelKwargs{.comm_hook = DDPCommunicationHookType::kBf16}.to_kwargs(),
            nlohmann::ordered_json::object());
  EXPECT_FALSE(DistributedDataParallelKwargs{}.to_dict().contains("comm_hook"));
  EXPECT_FALSE(DistributedDataParallelKwargs{}.to_dict().contains("comm_wrapper"));
  EXPECT_EQ(DistributedDataParallelKwargs{}.to_dict().size(), 7u);
  const auto changed = DistributedDataParallelKwargs{.dim = 0, .check_reduction = true}.to_kwargs();
  EXPECT_EQ(changed.dump(), R"({"check_reduction":true})");
}

}  // namespace
}  // namespace accelerate::testing
