// The L-GreCo search problem, as plain numbers.
//
// Layers l = 1..L each offer candidates c (a codec spec, its encoded size in bytes, its
// measured error e(l,c)); one candidate per layer is the layer's default (the uniform
// compression the user would otherwise run). Choose one candidate per layer to minimise
// the total cost (bytes, or predicted exchange time) subject to
//     sum_l e(l, c_l) <= alpha * sum_l e(l, default_l).
// A layer that must stay as it is has a single candidate.
//
// Nothing here knows NCCL, CUDA or JSON: the engine fills a Problem from its statistics,
// lgreco-solve from a file (controller/problem_json.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lgreco::controller {

// A problem that cannot be solved as given; the message names the field, e.g.
// "layers[3] (conv1).candidates[2].error: NaN; expected a finite number >= 0".
class ProblemError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// What the search minimises.
enum class Objective {
  kSize,  // total encoded bytes
  kTime,  // predicted exchange time, from CostModel
};
const char* objective_name(Objective objective);
bool parse_objective(std::string_view text, Objective* objective);

// Predicted time of one layer's candidate, in seconds:
//     latency + bytes / bandwidth + numel / throughput
// latency: fixed cost per message (a layer's share of a launch or a round trip);
// bandwidth: encoded bytes per second through the whole exchange, as the engine or the
//   net plugin measured it (encoded bytes of a step / its exchange time);
// throughput: elements per second the codec encodes plus decodes; 0 = not modelled.
// Each codec family ("none", "quant", ...) may override any of the three, because an
// uncompressed layer can travel a different path (NCCL's own allreduce) than a
// compressed one.
struct LinkCost {
  double bandwidth = 0;   // bytes/s, > 0
  double latency = 0;     // s, >= 0
  double throughput = 0;  // elements/s, >= 0 (0: codec time not modelled)
};
struct FamilyCost {  // unset: the CostModel's link value
  std::optional<double> bandwidth;
  std::optional<double> latency;
  std::optional<double> throughput;
};
struct CostModel {
  LinkCost link;
  std::map<std::string, FamilyCost, std::less<>> families;  // ordered: deterministic

  // The effective numbers for one family.
  LinkCost for_family(std::string_view family) const;
  double seconds(std::string_view family, uint64_t bytes, uint64_t numel) const;
};

// "quant" for "quant:bits=3": the codec family, the spec's text up to the first ':'.
std::string_view codec_family(std::string_view codec_spec);

struct Candidate {
  std::string codec;   // a codec spec string; opaque to the solver except its family
  uint64_t bytes = 0;  // encoded size
  double error = 0;    // measured error, finite and >= 0 (see controller/stats.h)
};

struct Layer {
  std::string name;
  uint64_t numel = 0;  // elements; needed only by a time objective with a throughput
  uint32_t default_index = 0;
  std::vector<Candidate> candidates;
};

struct Problem {
  double alpha = 1.0;  // error budget relative to the defaults, finite and >= 0
  Objective objective = Objective::kSize;
  CostModel cost_model;  // used by Objective::kTime only
  std::vector<Layer> layers;
};

// Largest candidate count per layer (the solver stores choices in a byte).
constexpr uint32_t kMaxCandidatesPerLayer = 255;

// Throws ProblemError naming the first invalid field.
void validate(const Problem& problem);

// "layers[3] (conv1)": how messages name a layer.
std::string layer_label(const Problem& problem, size_t layer);

}  // namespace lgreco::controller
