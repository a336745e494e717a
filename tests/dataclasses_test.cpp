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
}

TEST(DistributedType, EveryValueRoundTripsThroughItsSpelling) {
  for (auto type : {DistributedType::kNo, DistributedType::kMultiCpu, DistributedType::kMultiGpu}) {
    EXPECT_EQ(parse_distributed_type(to_string(type)), type) << to_string(type);
  }
}

TEST(DistributedType, DeepSpeedIsRefusedAsUnsupported) {
  EXPECT_THROWS_WITH(parse_distributed_type("DEEPSPEED"), "got 'DEEPSPEED'");
  EXPECT_THROWS_WITH(parse_distributed_type("DEEPSPEED"), "not supported");
}

TEST(DistributedType, OtherUpstreamTypesAndHostileTextAreRefused) {
  for (const char* text : {"FSDP", "XLA", "MEGATRON_LM", "", "multi cpu", "MULTI_CPU ", "NO\n"}) {
    EXPECT_THROWS_WITH(parse_distributed_type(text), "expected one of NO, MULTI_CPU, MULTI_GPU") << text;
  }
}

TEST(DistributedType, TheErrorIsAValueError) {
  EXPECT_THROW(parse_distributed_type("FSDP"), c10::ValueError);
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

}  // namespace
}  // namespace accelerate::testing
