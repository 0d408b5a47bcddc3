// LGRECO_* parameters: sources and precedence, every invalid value, the documentation
// table, the mapping to controller settings, and the command that shows them.
#include "config/params.h"

#include <boost/test/unit_test.hpp>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "controller/settings.h"
#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using test::contains;
using test::count_of;
using test::read_text;


// Sources with an in-memory file system.
struct FakeSources {
  std::map<std::string, std::string> files;
  std::set<std::string> unreadable;
  config::ParamSources sources;
  FakeSources() {
    sources.home = "/home/u";
    sources.read_file = [this](const std::string& path, bool* missing, std::string* error) -> std::optional<std::string> {
      if (unreadable.count(path)) {
        *error = "Permission denied";
        return std::nullopt;
      }
      const auto it = files.find(path);
      if (it == files.end()) {
        *missing = true;
        return std::nullopt;
      }
      return it->second;
    };
  }
  FakeSources& env(const std::string& name, const std::string& value) {
    sources.environment.emplace_back(name, value);
    return *this;
  }
  config::Params load() const { return config::load_params(sources); }
};

std::string all_errors(const config::Params& p) {
  std::string s;
  for (const std::string& e : p.errors) s += e + "\n";
  return s;
}
std::string all_warnings(const config::Params& p) {
  std::string s;
  for (const std::string& w : p.warnings) s += w + "\n";
  return s;
}


}  // namespace

BOOST_AUTO_TEST_SUITE(params)

BOOST_AUTO_TEST_CASE(defaults_are_the_table_defaults) {
  const config::Params p = FakeSources().load();
  BOOST_TEST(p.valid(), all_errors(p));
  BOOST_TEST(p.warnings.empty(), all_warnings(p));
  BOOST_TEST(p.conf_file.empty());
  BOOST_TEST_REQUIRE(p.entries.size() == config::param_table().size());
  for (size_t i = 0; i < p.entries.size(); ++i) {
    BOOST_TEST(p.entries[i].name == config::param_table()[i].name);
    BOOST_TEST(p.entries[i].value == config::param_table()[i].default_value);
    BOOST_TEST(p.entries[i].origin.str() == "default");
  }
  BOOST_TEST((p.mode == config::Mode::kAdaptive && p.effective_mode() == config::Mode::kAdaptive));
  BOOST_TEST(p.codec.str() == "quant:bits=4,bucket=1024,rounding=stochastic");
  BOOST_TEST_REQUIRE(p.candidates.size() == 7u);  // 2..8 bits
  for (int i = 0; i < 7; ++i) BOOST_TEST(p.candidates[i].quant_params().bits == i + 2);
  BOOST_TEST(p.alpha == 1.0);
  BOOST_TEST((p.warmup == 100u && p.period == 100u && p.window == 10u && p.switch_lag == 4u));
  BOOST_TEST((p.min_bytes == 262144u && p.segment_bytes == 1048576u));
  BOOST_TEST((p.debug_level == log::Level::kWarn));
}

BOOST_AUTO_TEST_CASE(file_and_environment_with_the_environment_winning) {
  FakeSources s;
  s.files["/home/u/.lgreco.conf"] =
      "# lgreco parameters\n"
      "  LGRECO_ALPHA = 0.75  \r\n"
      "\n"
      "LGRECO_PERIOD=50\n"
      "LGRECO_WINDOW=5\n"
      "LGRECO_SEGMENT_BYTES=4M\n"
      "LGRECO_CANDIDATES=quant:bits=2;quant:bits=8\n";
  s.files["/etc/lgreco.conf"] = "LGRECO_MODE=off\n";  // not read: the user's file comes first
  s.env("LGRECO_PERIOD", "40").env("LGRECO_TEST_ANYTHING", "ignored").env("LGRECO_MIN_BYTES", "");
  const config::Params p = s.load();
  BOOST_TEST(p.valid(), all_errors(p));
  BOOST_TEST(p.warnings.empty(), all_warnings(p));
  BOOST_TEST(p.conf_file == "/home/u/.lgreco.conf");
  BOOST_TEST(p.alpha == 0.75);
  BOOST_TEST(p.entry("LGRECO_ALPHA")->origin.str() == "/home/u/.lgreco.conf:2");
  BOOST_TEST(p.period == 40u);
  BOOST_TEST(p.entry("LGRECO_PERIOD")->origin.str() == "environment");
  BOOST_TEST(p.window == 5u);
  BOOST_TEST(p.segment_bytes == 4u << 20);
  BOOST_TEST(p.min_bytes == 262144u);  // empty counts as unset
  BOOST_TEST(p.entry("LGRECO_MIN_BYTES")->origin.str() == "default");
  BOOST_TEST((p.mode == config::Mode::kAdaptive));
  // The default codec always joins an explicit candidate list.
  BOOST_TEST_REQUIRE(p.candidates.size() == 3u);
  BOOST_TEST((p.candidates[2] == p.codec));

  FakeSources etc;
  etc.files["/etc/lgreco.conf"] = "LGRECO_MODE=uniform\n";
  BOOST_TEST((etc.load().mode == config::Mode::kUniform));
  etc.sources.home.clear();
  BOOST_TEST((etc.load().mode == config::Mode::kUniform));

  FakeSources named;
  named.files["/cfg/job.conf"] = "LGRECO_MODE=off\n";
  named.files["/home/u/.lgreco.conf"] = "LGRECO_MODE=uniform\n";
  named.env("LGRECO_CONF_FILE", "/cfg/job.conf");
  const config::Params n = named.load();
  BOOST_TEST(n.conf_file == "/cfg/job.conf");
  BOOST_TEST((n.mode == config::Mode::kOff));
}

BOOST_AUTO_TEST_CASE(unknown_names_and_bad_lines_warn_and_name_their_place) {
  FakeSources s;
  s.files["/home/u/.lgreco.conf"] =
      "LGRECO_ALHPA=2\n"
      "just words\n"
      "=3\n"
      "NCCL_DEBUG=INFO\n"
      "LGRECO_CONF_FILE=/x\n"
      "LGRECO_WARMUP=10\n"
      "LGRECO_WARMUP=20\n";
  s.env("LGRECO_PERIDO", "3");
  const config::Params p = s.load();
  BOOST_TEST(p.valid(), all_errors(p));
  const std::string w = all_warnings(p);
  BOOST_TEST(contains(w, "/home/u/.lgreco.conf:1: LGRECO_ALHPA is not an lgreco parameter (did you mean LGRECO_ALPHA?)"), w);
  BOOST_TEST(contains(w, "/home/u/.lgreco.conf:2: not a KEY=VALUE line; ignored"), w);
  BOOST_TEST(contains(w, "/home/u/.lgreco.conf:3: not a KEY=VALUE line"), w);
  BOOST_TEST(contains(w, "/home/u/.lgreco.conf:4: NCCL_DEBUG is not an lgreco parameter; ignored"), w);
  BOOST_TEST(contains(w, ":5: LGRECO_CONF_FILE is read only from the environment"), w);
  BOOST_TEST(contains(w, ":7: LGRECO_WARMUP is also set at line 6; this line wins"), w);
  BOOST_TEST(contains(w, "environment: LGRECO_PERIDO is not an lgreco parameter (did you mean LGRECO_PERIOD?)"), w);
  BOOST_TEST(p.warmup == 20u);
  BOOST_TEST(p.alpha == 1.0);
}

BOOST_AUTO_TEST_CASE(every_invalid_value_names_the_parameter_and_turns_compression_off) {
  const std::pair<const char*, const char*> bad[] = {
      {"LGRECO_MODE", "fast"},          {"LGRECO_AUTO", "yes"},
      {"LGRECO_CODEC", "quant:bits=0"}, {"LGRECO_CANDIDATES", "quant:bits=2;;quant:bits=3"},
      {"LGRECO_CANDIDATES", "quant:bits=2;quant:bits=2"},
      {"LGRECO_ALPHA", "0"},            {"LGRECO_ALPHA", "nan"},
      {"LGRECO_ALPHA", "1e9"},          {"LGRECO_ALPHA", "0.5x"},
      {"LGRECO_OBJECTIVE", "speed"},    {"LGRECO_ERROR_METRIC", "l1"},
      {"LGRECO_WARMUP", "1"},           {"LGRECO_WARMUP", "-5"},
      {"LGRECO_PERIOD", "0"},           {"LGRECO_WINDOW", "0"},
      {"LGRECO_SWITCH_LAG", "0"},       {"LGRECO_SOLVER_TOLERANCE", "1"},
      {"LGRECO_MIN_BYTES", "1T"},       {"LGRECO_MIN_BYTES", "99999999999999999999999"},
      {"LGRECO_SEGMENT_BYTES", "4095"}, {"LGRECO_SEGMENT_BYTES", "1.5M"},
      {"LGRECO_DECISION_LOG", "/tmp/d.%q"}, {"LGRECO_DEBUG", "LOUD"},
      {"LGRECO_DEBUG_FILE", "/tmp/x%"},  {"LGRECO_DEBUG_FILE", "/tmp/%r"},
      {"LGRECO_DEBUG_SUBSYS", "INIT,BOGUS"},
  };
  for (const auto& [name, value] : bad) {
    FakeSources s;
    s.env(name, value);
    const config::Params p = s.load();
    BOOST_TEST_REQUIRE(p.errors.size() == 1u, name << "=" << value << ": " << all_errors(p));
    const std::string& e = p.errors[0];
    BOOST_TEST(e.rfind(std::string(name) + "=" + value + " (environment): ", 0) == 0u, e);
    BOOST_TEST(contains(e, "; accepted: "), e);
    BOOST_TEST(!contains(e, "`"), e);
    BOOST_TEST((p.effective_mode() == config::Mode::kOff), name);
  }
  FakeSources from_file;
  from_file.files["/etc/lgreco.conf"] = "\nLGRECO_ALPHA=-1\n";
  const config::Params p = from_file.load();
  BOOST_TEST_REQUIRE(p.errors.size() == 1u);
  BOOST_TEST(contains(p.errors[0], "LGRECO_ALPHA=-1 (/etc/lgreco.conf:2): out of range; accepted: a number > 0"),
             p.errors[0]);
}

BOOST_AUTO_TEST_CASE(a_named_file_that_cannot_be_read_is_an_error_others_a_warning) {
  FakeSources missing;
  missing.env("LGRECO_CONF_FILE", "/nope.conf");
  const config::Params m = missing.load();
  BOOST_TEST_REQUIRE(m.errors.size() == 1u);
  BOOST_TEST(m.errors[0] == "LGRECO_CONF_FILE=/nope.conf: cannot read: no such file");
  FakeSources unreadable;
  unreadable.unreadable.insert("/home/u/.lgreco.conf");
  unreadable.files["/etc/lgreco.conf"] = "LGRECO_ALPHA=0.5\n";
  const config::Params u = unreadable.load();
  BOOST_TEST(u.valid());
  BOOST_TEST(contains(all_warnings(u), "/home/u/.lgreco.conf: cannot read: Permission denied; not used"));
  BOOST_TEST(u.alpha == 0.5);  // the next file is still read
}

BOOST_AUTO_TEST_CASE(review_regressions) {
  // A schedule that breaks its rules is a configuration error at load, like any value.
  FakeSources window;
  window.env("LGRECO_WINDOW", "500");
  const config::Params w = window.load();
  BOOST_TEST_REQUIRE(w.errors.size() == 1u);
  BOOST_TEST(contains(w.errors[0], "LGRECO_WINDOW=500, LGRECO_SWITCH_LAG=4: window 500: must be between 1"),
             w.errors[0]);
  BOOST_TEST((w.effective_mode() == config::Mode::kOff));
  // An empty environment value is unset: the file's value applies. So does an empty line.
  FakeSources empty;
  empty.files["/home/u/.lgreco.conf"] = "LGRECO_MODE=uniform\nLGRECO_MODE=\n";
  empty.env("LGRECO_MODE", "  ");
  const config::Params e = empty.load();
  BOOST_TEST((e.mode == config::Mode::kUniform));
  BOOST_TEST(e.entry("LGRECO_MODE")->origin.str() == "/home/u/.lgreco.conf:1");
  // Control characters (a binary file, a NUL inside a value) make a line ignored.
  FakeSources binary;
  const char with_nul[] = "LGRECO_WINDOW=5\0garbage\nLGRECO_PERIOD=50\n";
  binary.files["/home/u/.lgreco.conf"] = std::string(with_nul, sizeof with_nul - 1);
  const config::Params b = binary.load();
  BOOST_TEST(b.window == 10u);
  BOOST_TEST(b.period == 50u);
  BOOST_TEST(contains(all_warnings(b), "/home/u/.lgreco.conf:1: holds a control character"), all_warnings(b));
  // 32 listed candidates and a default outside them make 33: an error, not a silent 33rd.
  std::string list;
  for (int bucket = 1; bucket <= 32; ++bucket) list += (list.empty() ? "" : ";") + ("quant:bits=2,bucket=" + std::to_string(bucket * 32));
  FakeSources many;
  many.env("LGRECO_CANDIDATES", list);
  const config::Params m = many.load();
  BOOST_TEST_REQUIRE(m.errors.size() == 1u, all_errors(m));
  BOOST_TEST(contains(m.errors[0], "make 33"));
}

BOOST_AUTO_TEST_CASE(oversized_or_unreadable_parameter_files_are_named) {
  test::TempDir dir;
  const std::string big = dir.file("big.conf");
  {
    std::ofstream out(big);
    for (int i = 0; i < 120000; ++i) out << "# padding line number " << i << "\n";
    out << "LGRECO_MODE=off\n";
  }
  const std::string tool = test::bin_dir() + "/lgreco-config";
  const auto r = test::run_command("env -i LGRECO_CONF_FILE=" + big + " " + tool + " show");
  BOOST_TEST(r.exit_code == 1, r.output);
  BOOST_TEST(contains(r.output, "larger than 1 MiB; not a parameter file"), r.output);
  const auto d = test::run_command("env -i LGRECO_CONF_FILE=" + dir.file("") + " " + tool + " show");
  BOOST_TEST(d.exit_code == 1, d.output);
  BOOST_TEST(contains(d.output, "Is a directory"), d.output);
}

BOOST_AUTO_TEST_CASE(byte_sizes_accept_binary_suffixes) {
  for (const auto& [text, bytes] : {std::pair{"4096", 4096ull}, {"8K", 8192ull}, {"3m", 3ull << 20}, {"1G", 1ull << 30}}) {
    FakeSources s;
    s.env("LGRECO_SEGMENT_BYTES", text);
    const config::Params p = s.load();
    BOOST_TEST(p.valid(), all_errors(p));
    BOOST_TEST(p.segment_bytes == bytes, text);
  }
}

BOOST_AUTO_TEST_CASE(candidates_follow_the_default_codec) {
  FakeSources s;
  s.env("LGRECO_CODEC", "quant:bits=1,bucket=512,rounding=nearest");
  const config::Params p = s.load();
  BOOST_TEST_REQUIRE(p.candidates.size() == 8u);  // 1..8: the default joins the sweep
  for (const CodecSpec& c : p.candidates) {
    BOOST_TEST(c.quant_params().bucket == 512u);
    BOOST_TEST((c.quant_params().rounding == Rounding::kNearest));
  }
  FakeSources none;
  none.env("LGRECO_CODEC", "none");
  BOOST_TEST(none.load().candidates.size() == 1u);
  // TopK: densities around the default, those within (0, 1].
  FakeSources topk;
  topk.env("LGRECO_CODEC", "topk:density=0.01");
  std::vector<std::string> got;
  for (const CodecSpec& c : topk.load().candidates) got.push_back(c.str());
  const std::vector<std::string> want = {"topk:density=0.001", "topk:density=0.0025", "topk:density=0.005",
                                         "topk:density=0.01",  "topk:density=0.02",   "topk:density=0.05"};
  BOOST_TEST(got == want, boost::test_tools::per_element());
  FakeSources dense;
  dense.env("LGRECO_CODEC", "topk:density=0.5");
  BOOST_TEST(dense.load().candidates.size() == 5u);  // 0.05, 0.125, 0.25, 0.5, 1; 2.5 is no density
  // Several families in one list, the default joining them.
  FakeSources mixed;
  mixed.env("LGRECO_CANDIDATES", "quant:bits=2;quant:bits=8;topk:density=0.01;topk:density=0.05");
  const config::Params m = mixed.load();
  BOOST_TEST(m.valid(), all_errors(m));
  BOOST_TEST(m.candidates.size() == 5u);
}

BOOST_AUTO_TEST_CASE(path_patterns_expand) {
  std::string path, error;
  BOOST_TEST(config::expand_path_pattern("/l/%h.%p.r%r.100%%", "hpr", 3, &path, &error));
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  BOOST_TEST(path == "/l/" + std::string(host) + "." + std::to_string(getpid()) + ".r3.100%");
  BOOST_TEST(!config::expand_path_pattern("/l/%r", "hp", 3, &path, &error));
  BOOST_TEST(error == "%r is not a pattern sequence (%h, %p, %% accepted)");
  BOOST_TEST(!config::expand_path_pattern("/l/%", "hp", 3, &path, &error));
  BOOST_TEST(contains(error, "a lone % at the end"));
}

BOOST_AUTO_TEST_CASE(docs_config_md_holds_the_generated_table) {
  const std::string docs = read_text(test::env_or("LGRECO_TEST_SOURCE_DIR", ".") + "/docs/CONFIG.md");
  BOOST_TEST_REQUIRE(!docs.empty());
  BOOST_TEST(contains(docs, config::params_markdown_table()),
             "docs/CONFIG.md is out of date: replace its table with the output of `build/bin/lgreco-config docs`");
}

BOOST_AUTO_TEST_CASE(controller_settings_map_and_check_the_schedule) {
  FakeSources s;
  s.env("LGRECO_ALPHA", "0.8").env("LGRECO_OBJECTIVE", "time").env("LGRECO_ERROR_METRIC", "l2");
  s.env("LGRECO_WARMUP", "20").env("LGRECO_PERIOD", "30").env("LGRECO_WINDOW", "4").env("LGRECO_SWITCH_LAG", "2");
  s.env("LGRECO_SOLVER_TOLERANCE", "0.01").env("LGRECO_DECISION_LOG", "/logs/d.r%r.jsonl");
  const controller::ControllerSettings c = controller::settings_from_params(s.load(), 7);
  BOOST_TEST(c.alpha == 0.8);
  BOOST_TEST((c.objective == controller::Objective::kTime));
  BOOST_TEST((c.metric == controller::ErrorMetric::kL2));
  BOOST_TEST((c.schedule.warmup == 20u && c.schedule.period == 30u && c.schedule.window == 4u &&
              c.schedule.switch_lag == 2u));
  BOOST_TEST(c.solver.tolerance == 0.01);
  BOOST_TEST(c.decision_log_path == "/logs/d.r7.jsonl");

  FakeSources bad;
  bad.env("LGRECO_WINDOW", "60").env("LGRECO_SWITCH_LAG", "50");
  try {
    controller::settings_from_params(bad.load(), 0);
    BOOST_FAIL("no error");
  } catch (const std::invalid_argument& e) {
    BOOST_TEST(contains(e.what(), "LGRECO_WARMUP=100, LGRECO_PERIOD=100, LGRECO_WINDOW=60, LGRECO_SWITCH_LAG=50: "
                                  "window 60 + switch lag 50: must be at most period + 1"),
               e.what());
  }
}

BOOST_AUTO_TEST_CASE(lgreco_config_show_prints_values_origins_and_problems) {
  test::TempDir dir;
  const std::string conf = dir.file("job.conf");
  {
    std::ofstream(conf) << "LGRECO_ALPHA=0.9\nLGRECO_WINDOW=200\n";
  }
  const std::string tool = test::bin_dir() + "/lgreco-config";
  const auto ok = test::run_command("env -i LGRECO_CONF_FILE=" + conf + " LGRECO_PERIOD=300 " + tool + " show");
  BOOST_TEST(ok.exit_code == 0, ok.output);
  BOOST_TEST(contains(ok.output, "LGRECO_ALPHA=0.9  # " + conf + ":1"), ok.output);
  BOOST_TEST(contains(ok.output, "LGRECO_PERIOD=300  # environment"), ok.output);
  BOOST_TEST(contains(ok.output, "LGRECO_MODE=adaptive  # default"), ok.output);
  BOOST_TEST(contains(ok.output, "# valid; mode in effect: adaptive"), ok.output);

  const auto bad = test::run_command("env -i LGRECO_CONF_FILE=" + conf + " LGRECO_MODE=fast " + tool + " show");
  BOOST_TEST(bad.exit_code == 1, bad.output);
  BOOST_TEST(contains(bad.output, "error: LGRECO_MODE=fast (environment): not one of the accepted values"), bad.output);
  BOOST_TEST(contains(bad.output, "LGRECO_SWITCH_LAG=4: window 200: must be between 1 and the period (100)"),
             bad.output);
  BOOST_TEST(contains(bad.output, "runs with compression off"), bad.output);

  const auto reg = test::run_command("env -i LGRECO_REGISTRATION=" + dir.file("none.json") + " " + tool + " show");
  BOOST_TEST(reg.exit_code == 1, reg.output);
  BOOST_TEST(contains(reg.output, "LGRECO_REGISTRATION: " + dir.file("none.json") + ": cannot open"), reg.output);

  const auto docs = test::run_command(tool + " docs");
  BOOST_TEST(docs.exit_code == 0);
  BOOST_TEST(docs.output == config::params_markdown_table());
  BOOST_TEST(test::run_command(tool + " frobnicate").exit_code == 2);
  BOOST_TEST(test::run_command(tool + " --help").exit_code == 0);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco
