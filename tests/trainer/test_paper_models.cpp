// Every cell of every paper spec, at every scale, is a model the trainer builds: its
// config passes validate_model_config and every layer's mixer is constructed (parameter
// shapes only, nothing allocated) — so a head layout the linear mixers refuse (say, value
// heads that are not a multiple of the key heads) shows here, not in a launched run.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.hpp"
#include "experiments/cell.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"

namespace fs = std::filesystem;
using namespace lar;

TEST(PaperModels, EveryCellBuilds) {
  int cells = 0;
  for (const auto& paper : fs::directory_iterator(LAR_SOURCE_DIR "/experiments/papers")) {
    if (!paper.is_directory()) continue;
    for (const auto& f : fs::directory_iterator(paper.path())) {
      const std::string stem = f.path().stem().string();
      if (f.path().extension() != ".yaml" || stem == "common" || stem == "notes") continue;
      for (const char* scale : {"smoke", "mini", "paper"}) {
        const auto plan = experiments::load_plan(f.path(), scale);
        for (const auto& c : plan.cells) {
          const std::string what = f.path().string() + " @ " + scale + ": " + c.id;
          try {
            trainer::validate_model_config(c.config);
            const json& m = c.config.at("model");
            for (int l = 0; l < m.at("n_layers").get<int>(); ++l)
              EXPECT_FALSE(trainer::make_mixer(trainer::mixer_config(m, l))->params().empty()) << what;
          } catch (const UserError& e) {
            ADD_FAILURE() << what << ": " << e.what();
          }
          ++cells;
        }
      }
    }
  }
  EXPECT_GT(cells, 300);
}
