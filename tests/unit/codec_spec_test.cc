#include "kernels/codec_spec.h"

#include <boost/test/unit_test.hpp>
#include <string>

using namespace lgreco;

namespace {
// The message of the CodecError that parsing `spec` throws ("" if it parses).
std::string parse_error(const std::string& spec) {
  try {
    CodecSpec::parse(spec);
  } catch (const CodecError& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

BOOST_AUTO_TEST_SUITE(codec_spec)

BOOST_AUTO_TEST_CASE(defaults_and_canonical_form) {
  const CodecSpec q = CodecSpec::parse("quant");
  BOOST_TEST(q.quant_params().bits == 4);
  BOOST_TEST(q.quant_params().bucket == 1024u);
  BOOST_TEST((q.quant_params().rounding == Rounding::kStochastic));
  BOOST_TEST(q.str() == "quant:bits=4,bucket=1024,rounding=stochastic");
  BOOST_TEST(CodecSpec::parse("none").str() == "none");
  BOOST_TEST((CodecSpec::parse("none").family() == CodecFamily::kNone));
}

BOOST_AUTO_TEST_CASE(options_in_any_order_round_trip) {
  const CodecSpec a = CodecSpec::parse("quant:rounding=nearest,bucket=96,bits=1");
  BOOST_TEST(a.quant_params().bits == 1);
  BOOST_TEST(a.quant_params().bucket == 96u);
  BOOST_TEST((a.quant_params().rounding == Rounding::kNearest));
  BOOST_TEST((CodecSpec::parse(a.str()) == a));
  for (int bits = 1; bits <= 8; ++bits)
    for (uint32_t bucket : {32u, 1024u, 1u << 20}) {
      const CodecSpec s = CodecSpec::quant(QuantParams{bits, bucket, Rounding::kStochastic});
      BOOST_TEST((CodecSpec::parse(s.str()) == s));
    }
}

BOOST_AUTO_TEST_CASE(errors_name_the_offending_part) {
  BOOST_TEST(contains(parse_error("quant:bits=9"), "bits=9 is out of range"));
  BOOST_TEST(contains(parse_error("quant:bits=0"), "bits=0"));
  BOOST_TEST(contains(parse_error("quant:bits=4.5"), "bits=4.5"));
  BOOST_TEST(contains(parse_error("quant:bits=-4"), "bits=-4"));
  BOOST_TEST(contains(parse_error("quant:bits=99999999999999999999"), "bits=9999"));
  BOOST_TEST(contains(parse_error("quant:bucket=100"), "bucket=100"));
  BOOST_TEST(contains(parse_error("quant:bucket=0"), "bucket=0"));
  BOOST_TEST(contains(parse_error("quant:bucket=2097152"), "bucket=2097152"));
  BOOST_TEST(contains(parse_error("quant:rounding=up"), "rounding=up"));
  BOOST_TEST(contains(parse_error("quant:bit=4"), "unknown option \"bit\""));
  BOOST_TEST(contains(parse_error("quant:bits=4,bits=5"), "\"bits\" is given twice"));
  BOOST_TEST(contains(parse_error("quant:bits"), "not of the form key=value"));
  BOOST_TEST(contains(parse_error("quant:bits="), "has no value"));
  BOOST_TEST(contains(parse_error("quant:=4"), "has no key"));
  BOOST_TEST(contains(parse_error("quant:"), "nothing after ':'"));
  BOOST_TEST(contains(parse_error("quant:bits=4,"), "empty option"));
  BOOST_TEST(contains(parse_error("qant:bits=4"), "unknown codec family \"qant\""));
  BOOST_TEST(contains(parse_error(""), "missing codec family"));
  BOOST_TEST(contains(parse_error("none:bits=4"), "none takes no options"));
  BOOST_TEST(contains(parse_error("quant: bits=4"), "\" bits\""));
  // Every message quotes the whole spec.
  BOOST_TEST(contains(parse_error("quant:bits=9"), "codec spec \"quant:bits=9\""));
}

BOOST_AUTO_TEST_CASE(validate_rejects_bad_params) {
  BOOST_CHECK_THROW(CodecSpec::quant(QuantParams{9, 1024, Rounding::kNearest}), CodecError);
  BOOST_CHECK_THROW(CodecSpec::quant(QuantParams{4, 33, Rounding::kNearest}), CodecError);
  BOOST_CHECK_NO_THROW(CodecSpec::quant(QuantParams{4, 64, Rounding::kNearest}));
}

BOOST_AUTO_TEST_SUITE_END()
