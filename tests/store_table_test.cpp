// The keys and values of the job's store (src/detail/store_table.h), without a connection: what
// each request answers, which requests wait for a key, and the cap on what keys and values take.
#include "detail/store_protocol.h"
#include "detail/store_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using accelerate::detail::StoreReply;
using accelerate::detail::StoreTable;
namespace proto = accelerate::detail::store_protocol;

StoreReply answer(StoreTable& table, proto::Op op, std::vector<std::string> args) {
  auto reply = table.execute(op, args);
  EXPECT_TRUE(reply.has_value()) << "the request waited";
  return reply.value_or(StoreReply{});
}

TEST(StoreTable, AGetOfAMissingKeyWaitsAndIsAnsweredOnceTheKeyIsWritten) {
  StoreTable table(size_t{1} << 20);
  std::vector<std::string> get = {"k"};
  EXPECT_FALSE(table.execute(proto::Op::kGet, get).has_value());
  EXPECT_EQ(get, std::vector<std::string>{"k"});  // kept for the retry
  const auto set = answer(table, proto::Op::kSet, {"k", "v"});
  EXPECT_EQ(set.status, proto::kReplyOk);
  EXPECT_TRUE(set.wrote);
  const auto got = answer(table, proto::Op::kGet, {"k"});
  EXPECT_EQ(got.strings, std::vector<std::string>{"v"});
  EXPECT_FALSE(got.wrote);
}

TEST(StoreTable, AWaitIsAnsweredOnlyOnceEveryKeyExists) {
  StoreTable table(size_t{1} << 20);
  answer(table, proto::Op::kSet, {"a", "1"});
  std::vector<std::string> keys = {"a", "b"};
  EXPECT_FALSE(table.execute(proto::Op::kWait, keys).has_value());
  EXPECT_EQ(answer(table, proto::Op::kCheck, {"a", "b"}).strings, std::vector<std::string>{"0"});
  answer(table, proto::Op::kSet, {"b", "2"});
  EXPECT_EQ(answer(table, proto::Op::kWait, {"a", "b"}).status, proto::kReplyOk);
  EXPECT_EQ(answer(table, proto::Op::kCheck, {"a", "b"}).strings, std::vector<std::string>{"1"});
  EXPECT_EQ(answer(table, proto::Op::kNumKeys, {}).strings, std::vector<std::string>{"2"});
}

TEST(StoreTable, AddSumsAndRefusesAKeyThatDoesNotHoldAnInteger) {
  StoreTable table(size_t{1} << 20);
  EXPECT_EQ(answer(table, proto::Op::kAdd, {"n", "3"}).strings, std::vector<std::string>{"3"});
  EXPECT_EQ(answer(table, proto::Op::kAdd, {"n", "-5"}).strings, std::vector<std::string>{"-2"});
  answer(table, proto::Op::kSet, {"text", "abc"});
  const auto refused = answer(table, proto::Op::kAdd, {"text", "1"});
  EXPECT_EQ(refused.status, proto::kReplyError);
  ASSERT_EQ(refused.strings.size(), 1u);
  EXPECT_THAT(refused.strings[0], testing::HasSubstr("'text' does not hold an integer"));
  EXPECT_FALSE(refused.wrote);
}

TEST(StoreTable, CompareSetWritesOnlyWhenTheKeyHoldsTheExpectedValue) {
  StoreTable table(size_t{1} << 20);
  // A missing key is written only when the expected value is empty.
  EXPECT_EQ(answer(table, proto::Op::kCompareSet, {"k", "x", "y"}).strings, std::vector<std::string>{"x"});
  EXPECT_EQ(answer(table, proto::Op::kCheck, {"k"}).strings, std::vector<std::string>{"0"});
  EXPECT_EQ(answer(table, proto::Op::kCompareSet, {"k", "", "first"}).strings, std::vector<std::string>{"first"});
  const auto mismatch = answer(table, proto::Op::kCompareSet, {"k", "other", "second"});
  EXPECT_EQ(mismatch.strings, std::vector<std::string>{"first"});
  EXPECT_FALSE(mismatch.wrote);
  const auto match = answer(table, proto::Op::kCompareSet, {"k", "first", "second"});
  EXPECT_EQ(match.strings, std::vector<std::string>{"second"});
  EXPECT_TRUE(match.wrote);
}

TEST(StoreTable, AWriteBeyondTheCapIsRefusedNamingTheKeyAndChangesNothing) {
  StoreTable table(1024);
  answer(table, proto::Op::kSet, {"small", "v"});
  const auto refused = answer(table, proto::Op::kSet, {"big", std::string(2048, 'x')});
  EXPECT_EQ(refused.status, proto::kReplyError);
  EXPECT_THAT(refused.over_cap, testing::HasSubstr("storing 'big' (2048 bytes)"));
  EXPECT_THAT(refused.over_cap, testing::HasSubstr("over their cap of 1 KiB (1 key stored)"));
  EXPECT_FALSE(refused.wrote);
  EXPECT_EQ(answer(table, proto::Op::kNumKeys, {}).strings, std::vector<std::string>{"1"});
  // Deleting makes room again.
  EXPECT_EQ(answer(table, proto::Op::kDelete, {"small"}).strings, std::vector<std::string>{"1"});
  EXPECT_EQ(answer(table, proto::Op::kDelete, {"small"}).strings, std::vector<std::string>{"0"});
  EXPECT_TRUE(answer(table, proto::Op::kSet, {"big", std::string(512, 'x')}).over_cap.empty());
}

TEST(StoreTable, ARequestWithTheWrongNumberOfStringsIsMalformed) {
  StoreTable table(size_t{1} << 20);
  for (const auto op :
       {proto::Op::kSet, proto::Op::kGet, proto::Op::kAdd, proto::Op::kCompareSet, proto::Op::kDelete}) {
    const auto reply = answer(table, op, {"a", "b", "c", "d"});
    EXPECT_EQ(reply.status, proto::kReplyError);
    EXPECT_EQ(reply.strings, std::vector<std::string>{"malformed request"});
  }
  EXPECT_EQ(answer(table, static_cast<proto::Op>(99), {}).strings, std::vector<std::string>{"unknown operation"});
}

}  // namespace
