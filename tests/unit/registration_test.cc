// The registration file: parsing, every validation rule with its message, the default
// never-compress rules, and random valid files with random single faults.
#include "config/registration.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using test::contains;
using test::count_of;
using test::read_text;

using config::RegistrationError;
using nlohmann::json;

const char kExample[] = R"({"version": 1, "model": "mlp", "buckets": [
  {"count": 4195328, "dtype": "float32", "layers": [
    {"name": "fc2.weight", "offset": 0, "numel": 4194304, "shape": [1024, 4096]},
    {"name": "fc2.bias", "offset": 4194304, "numel": 1024, "shape": [1024], "compress": "never"}]}]})";

json example() { return json::parse(kExample); }

std::string error_of(const std::string& text) {
  try {
    config::parse_registration(text, "model.json");
  } catch (const RegistrationError& e) {
    return e.what();
  }
  return "(no error)";
}
std::string error_of_json(const json& j) { return error_of(j.dump()); }


// A valid random registration: buckets of random layers with random shapes.
json random_registration(std::mt19937_64& rng) {
  json root = {{"version", 1}, {"model", "random"}, {"buckets", json::array()}};
  const char* dtypes[] = {"float32", "float16", "bfloat16"};
  int name = 0;
  const int buckets = 1 + rng() % 4;
  for (int b = 0; b < buckets; ++b) {
    json bucket = {{"dtype", dtypes[rng() % 3]}, {"layers", json::array()}};
    uint64_t offset = 0;
    const int layers = 1 + rng() % 6;
    for (int l = 0; l < layers; ++l) {
      std::vector<uint64_t> shape;
      const int dims = rng() % 4;
      uint64_t numel = 1;
      for (int d = 0; d < dims; ++d) {
        shape.push_back(1 + rng() % 70);
        numel *= shape.back();
      }
      json layer = {{"name", "layer" + std::to_string(name++)}, {"offset", offset}, {"numel", numel}, {"shape", shape}};
      if (rng() % 5 == 0) layer["compress"] = rng() % 2 ? "never" : "quant:bits=3";
      bucket["layers"].push_back(layer);
      offset += numel;
    }
    // Buckets whose counts repeat with other layers are refused (a call could not tell
    // them apart), rightly: keep the random ones' counts distinct with a one-element layer.
    while (std::any_of(root["buckets"].begin(), root["buckets"].end(),
                       [&](const json& other) { return other["count"].get<uint64_t>() == offset; })) {
      bucket["layers"].push_back({{"name", "layer" + std::to_string(name++)}, {"offset", offset}, {"numel", 1},
                                  {"shape", json::array({1})}});
      offset += 1;
    }
    bucket["count"] = offset;
    root["buckets"].push_back(bucket);
  }
  return root;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(registration)

BOOST_AUTO_TEST_CASE(the_issue_example_parses) {
  const config::Registration r = config::parse_registration(kExample, "mlp.json");
  BOOST_TEST(r.source == "mlp.json");
  BOOST_TEST(r.model == "mlp");
  BOOST_TEST_REQUIRE(r.buckets.size() == 1u);
  const config::RegisteredBucket& b = r.buckets[0];
  BOOST_TEST(b.count == 4195328u);
  BOOST_TEST((b.dtype == DType::kFloat32));
  BOOST_TEST_REQUIRE(b.layers.size() == 2u);
  BOOST_TEST(b.layers[0].name == "fc2.weight");
  BOOST_TEST((b.layers[0].shape == std::vector<uint64_t>{1024, 4096}));
  BOOST_TEST(b.layers[0].compress.str() == "auto");
  BOOST_TEST(b.layers[1].offset == 4194304u);
  BOOST_TEST(b.layers[1].compress.str() == "never");
  BOOST_TEST(r.layer_count() == 2u);
  BOOST_TEST((config::layer_policy(b.layers[0]).kind == config::LayerPolicy::Kind::kAdaptive));
  BOOST_TEST((config::layer_policy(b.layers[1]).kind == config::LayerPolicy::Kind::kNever));
}

BOOST_AUTO_TEST_CASE(every_rule_is_an_error_naming_file_path_and_problem) {
  struct Case {
    std::function<void(json&)> mutate;
    std::string expected;
  };
  const Case cases[] = {
      {[](json& j) { j["buckets"][0]["layers"][1]["offset"] = 4194305; },
       "model.json: buckets[0].layers[1] (fc2.bias).offset: 4194305 leaves a gap of 1 elements after "
       "buckets[0].layers[0] (fc2.weight), which ends at 4194304"},
      {[](json& j) { j["buckets"][0]["layers"][1]["offset"] = 4194303; },
       "buckets[0].layers[1] (fc2.bias).offset: 4194303 overlaps buckets[0].layers[0] (fc2.weight), which ends at "
       "4194304"},
      {[](json& j) {
         j["buckets"][0]["layers"] = json::parse(R"([
           {"name": "a", "offset": 0, "numel": 1024, "shape": [1024]},
           {"name": "b", "offset": 2048, "numel": 1024, "shape": [1024]},
           {"name": "c", "offset": 1024, "numel": 1024, "shape": [1024]}])");
         j["buckets"][0]["count"] = 3072;
       },
       "buckets[0].layers[1] (b).offset: 2048 leaves a gap"},
      {[](json& j) {
         j["buckets"][0]["layers"] = json::parse(R"([
           {"name": "a", "offset": 0, "numel": 2048, "shape": [2048]},
           {"name": "b", "offset": 2048, "numel": 1024, "shape": [1024]},
           {"name": "c", "offset": 1024, "numel": 1024, "shape": [1024]}])");
         j["buckets"][0]["count"] = 4096;
       },
       "buckets[0].layers[2] (c).offset: 1024 is out of order (before buckets[0].layers[1] (b) at 2048)"},
      {[](json& j) { j["buckets"][0]["layers"][0]["offset"] = 5; }, "(fc2.weight).offset: 5; the first layer must begin at 0"},
      {[](json& j) { j["buckets"][0]["count"] = 4195329; },
       "model.json: buckets[0]: the layers hold 4195328 elements, but count is 4195329"},
      {[](json& j) { j["buckets"][0]["count"] = 4195327; }, "(fc2.bias).numel: 1024 runs past the bucket's count (4195327)"},
      {[](json& j) { j["buckets"][0]["layers"][0]["shape"] = {1024, 4095}; },
       "buckets[0].layers[0] (fc2.weight).shape: [1024, 4095] holds 4193280 elements, but numel is 4194304"},
      {[](json& j) { j["buckets"][0]["layers"][0]["shape"] = {1ull << 40, 1ull << 40}; }, "holds more than 2^64 elements"},
      {[](json& j) { j["buckets"][0]["dtype"] = "float64"; },
       "buckets[0].dtype: \"float64\" is not a dtype lgreco compresses (float32, float16, bfloat16)"},
      {[](json& j) { j["buckets"][0]["layers"][1]["name"] = "fc2.weight"; },
       "buckets[0].layers[1] (fc2.weight).name: \"fc2.weight\" is also the name of buckets[0].layers[0] (fc2.weight)"},
      {[](json& j) { j["buckets"][0]["layers"][0]["stride"] = 1; },
       "buckets[0].layers[0] (fc2.weight).stride: unknown key (expected one of: name, offset, numel, shape, compress)"},
      {[](json& j) { j["buckets"][0]["ptr"] = 1; }, "buckets[0].ptr: unknown key"},
      {[](json& j) { j["modle"] = "x"; }, "model.json: modle: unknown key"},
      {[](json& j) { j["version"] = 2; }, "version: 2; this lgreco reads version 1"},
      {[](json& j) { j.erase("version"); }, "version: missing"},
      {[](json& j) { j["buckets"] = json::array(); }, "buckets: empty"},
      {[](json& j) { j["buckets"][0]["layers"] = json::array(); }, "buckets[0].layers: empty"},
      {[](json& j) { j["buckets"][0]["count"] = 0; }, "buckets[0].count: 0"},
      {[](json& j) { j["buckets"][0]["count"] = (1ull << 48) + 1; }, "larger than lgreco accepts"},
      {[](json& j) { j["buckets"][0]["count"] = -3; }, "buckets[0].count: -3; expected a non-negative integer"},
      {[](json& j) { j["buckets"][0]["count"] = 12.5; }, "buckets[0].count: 12.5; expected a non-negative integer"},
      {[](json& j) { j["buckets"][0]["layers"][1]["numel"] = 0; }, "(fc2.bias).numel: 0"},
      {[](json& j) { j["buckets"][0]["layers"][1]["name"] = ""; }, "buckets[0].layers[1].name: empty"},
      {[](json& j) { j["buckets"][0]["layers"][1].erase("shape"); }, "(fc2.bias).shape: missing"},
      {[](json& j) { j["buckets"][0]["layers"][1]["shape"] = {-1}; }, "(fc2.bias).shape[0]: -1; expected a non-negative"},
      {[](json& j) { j["buckets"][0]["layers"][1]["compress"] = "quant:bits=9"; }, "(fc2.bias).compress: "},
      {[](json& j) { j["buckets"][0]["layers"][1]["compress"] = "sometimes"; }, "(fc2.bias).compress: "},
      {[](json& j) { j["generator"] = "me"; }, "generator: expected an object"},
      {[](json& j) { j["buckets"][0]["layers"][0] = 7; }, "buckets[0].layers[0]: expected an object"},
  };
  for (const Case& c : cases) {
    json j = example();
    c.mutate(j);
    const std::string error = error_of_json(j);
    BOOST_TEST(contains(error, c.expected), "got: " << error << "\nexpected: " << c.expected);
    BOOST_TEST(error.rfind("model.json: ", 0) == 0u, error);
  }
  BOOST_TEST(contains(error_of(R"({"version": 1, "version": 1, "buckets": []})"), "duplicate key \"version\""));
  BOOST_TEST(contains(error_of("{\"version\": 1,\n \"buckets\": [NaN]}"), "line 2"));
  BOOST_TEST(contains(error_of(""), "not valid JSON"));
}

BOOST_AUTO_TEST_CASE(pinned_codecs_and_defaults_apply) {
  json j = example();
  j["buckets"][0]["layers"][1]["compress"] = "quant:bits=8,bucket=64";
  const config::Registration r = config::parse_registration(j.dump(), "");
  const config::LayerPolicy pinned = config::layer_policy(r.buckets[0].layers[1]);
  BOOST_TEST((pinned.kind == config::LayerPolicy::Kind::kPinned));
  BOOST_TEST(pinned.codec.str() == "quant:bits=8,bucket=64,rounding=stochastic");

  config::RegisteredLayer layer;
  layer.numel = 4096;
  layer.shape = {4096};
  BOOST_TEST(config::layer_policy(layer).reason == std::string("one dimension"));
  layer.shape = {64, 64};
  BOOST_TEST((config::layer_policy(layer).kind == config::LayerPolicy::Kind::kAdaptive));
  layer.numel = 1023;
  layer.shape = {31, 33};
  BOOST_TEST(config::layer_policy(layer).reason == std::string("under 1024 elements"));
  layer.numel = 1;
  layer.shape = {};
  BOOST_TEST(config::layer_policy(layer).reason == std::string("a scalar"));
  layer.numel = 5000;  // auto segments have no shape: only the size rule applies
  layer.has_shape = false;
  BOOST_TEST((config::layer_policy(layer).kind == config::LayerPolicy::Kind::kAdaptive));
}

BOOST_AUTO_TEST_CASE(low_rank_rule_is_the_reference_inequality) {
  config::RegisteredLayer layer;
  std::mt19937_64 rng(test::run_seed());
  for (int i = 0; i < 2000; ++i) {
    const uint64_t n = 1 + rng() % 3000, m = 1 + rng() % 3000, r = 1 + rng() % 64;
    layer.shape = {n, m};
    layer.numel = n * m;
    BOOST_TEST(config::low_rank_pays_off(layer, r) == ((n + m) * r * 2 < n * m), n << "x" << m << " rank " << r);
  }
  layer.shape = {64, 3, 3, 3};  // a conv: 64 x 27
  layer.numel = 64 * 27;
  BOOST_TEST(config::low_rank_pays_off(layer, 4));    // (64 + 27) * 8 = 728 < 1728
  BOOST_TEST(!config::low_rank_pays_off(layer, 10));  // 1820 >= 1728
  layer.shape = {1728};
  BOOST_TEST(!config::low_rank_pays_off(layer, 1));
  layer.has_shape = false;
  layer.shape = {64, 27};
  BOOST_TEST(!config::low_rank_pays_off(layer, 1));
  layer.has_shape = true;
  layer.shape = {uint64_t{1} << 40, uint64_t{1} << 8};  // products beyond 64 bits do not overflow
  layer.numel = uint64_t{1} << 48;
  BOOST_TEST(config::low_rank_pays_off(layer, 4));
}

BOOST_AUTO_TEST_CASE(random_files_parse_and_random_faults_are_caught) {
  std::mt19937_64 rng(test::run_seed());
  for (int trial = 0; trial < 300; ++trial) {
    json j = random_registration(rng);
    const config::Registration r = config::parse_registration(j.dump(), "r.json");
    BOOST_TEST_REQUIRE(r.buckets.size() == j["buckets"].size());
    for (size_t b = 0; b < r.buckets.size(); ++b) {
      BOOST_TEST(r.buckets[b].count == j["buckets"][b]["count"].get<uint64_t>());
      BOOST_TEST(r.buckets[b].layers.size() == j["buckets"][b]["layers"].size());
    }
    config::validate(r);
    // One random fault; each must be reported, naming the bucket.
    const size_t b = rng() % j["buckets"].size();
    json& layers = j["buckets"][b]["layers"];
    const size_t l = rng() % layers.size();
    switch (rng() % 5) {
      case 0: j["buckets"][b]["count"] = j["buckets"][b]["count"].get<uint64_t>() + 1 + rng() % 5; break;
      case 1: layers[l]["offset"] = layers[l]["offset"].get<uint64_t>() + 1; break;
      case 2: layers[l]["numel"] = layers[l]["numel"].get<uint64_t>() + 1; break;
      case 3: layers[l]["name"] = layers[(l + 1) % layers.size()]["name"]; if (layers.size() == 1) layers[l]["name"] = ""; break;
      case 4: layers[l]["shape"].push_back(2); break;
    }
    const std::string error = error_of_json(j);
    BOOST_TEST(contains(error, "buckets[" + std::to_string(b) + "]"), error << "\n" << j.dump());
  }
}

BOOST_AUTO_TEST_CASE(deep_nesting_and_huge_values_give_short_errors) {
  // 100,000 nested arrays crashed the message writer (nlohmann's dump recurses).
  const std::string deep = "{\"version\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  const std::string error = error_of(deep);
  BOOST_TEST(contains(error, "nested deeper than 32 levels"), error.substr(0, 200));
  json j = example();
  j["buckets"][0]["count"] = json::array({json::array({1, 2, 3})});
  BOOST_TEST(contains(error_of_json(j), "buckets[0].count: an array; expected"), error_of_json(j));
  j = example();
  j["buckets"][0]["layers"][0]["name"] = std::string(500, 'x');
  j["buckets"][0]["layers"][0]["offset"] = "a long string " + std::string(200, 'y');
  BOOST_TEST(error_of_json(j).size() < 800u);
}

BOOST_AUTO_TEST_CASE(counts_that_cannot_tell_buckets_apart_are_refused) {
  // Counts repeating every 2 buckets with different layers: a call cannot tell bucket 0
  // from bucket 2.
  json j = example();
  json bucket = j["buckets"][0];
  json other = bucket;
  other["count"] = 5000;
  other["layers"] = json::parse(R"([{"name": "o", "offset": 0, "numel": 5000, "shape": [50, 100]}])");
  json twin = bucket;  // bucket 0's count with another layout
  twin["layers"][0]["shape"] = {4096, 1024};
  twin["layers"][0]["name"] = "twin.weight";
  twin["layers"][1]["name"] = "twin.bias";
  json other2 = other;
  other2["layers"][0]["name"] = "o2";
  j["buckets"] = json::array({bucket, other, twin, other2});
  BOOST_TEST(contains(error_of_json(j), "buckets: the counts and dtypes repeat every 2 buckets but the layers do not"),
             error_of_json(j));
  // The same with identical layers (only names differ) is harmless and accepted.
  twin["layers"][0]["shape"] = {1024, 4096};
  j["buckets"] = json::array({bucket, other, twin, other2});
  BOOST_TEST(error_of_json(j) == "(no error)");
  // Shared counts that do not repeat periodically are fine (BERT: 12 equal encoder buckets).
  j["buckets"] = json::array({other, bucket, twin});
  BOOST_TEST(error_of_json(j) == "(no error)");
}

BOOST_AUTO_TEST_CASE(files_that_cannot_be_read_are_named) {
  try {
    config::load_registration("/nonexistent/registration.json");
    BOOST_FAIL("no error");
  } catch (const RegistrationError& e) {
    BOOST_TEST(contains(e.what(), "/nonexistent/registration.json: cannot open: No such file"), e.what());
  }
  test::TempDir dir;
  const std::string path = dir.file("r.json");
  test::write_bytes(path, kExample, sizeof kExample - 1);
  BOOST_TEST(config::load_registration(path).source == path);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco
