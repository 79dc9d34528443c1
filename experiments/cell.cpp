#include "experiments/cell.hpp"

namespace lar::experiments {

json Cell::run_config_json() const {
  json axes_obj = json::object();
  for (const auto& [name, value] : axes) axes_obj[name] = value;
  return json{{"experiment", experiment},
              {"cell_id", id},
              {"hash", hash},
              {"axes", axes_obj},
              {"role", role},
              {"baseline", baseline ? json(*baseline) : json(nullptr)},
              {"config", config}};
}

}  // namespace lar::experiments
