// The reference API's flow, for every zero_dp_strategy at 1, 2 and 4 ranks: an optimizer built
// before wrapping is used afterwards; parameters replaced on the module after wrapping (as loading
// weights does) are taken back by name into the sharded buffers; full weights load by name.
// Needs MFSDP_FIXTURE (the directory tests/train/fixture.sh fills).
#include <ATen/ATen.h>

#include "mpi_test_main.h"
#include "comm/mpi_env.h"
#include "config/config.h"
#include "fsdp/engine.h"
#include "mesh/process_groups.h"
#include "model/graph_rewrite.h"
#include "model/model.h"
#include "optim/optimizer.h"

using namespace mfsdp;

namespace {

std::string fixture() {
  const char* d = std::getenv("MFSDP_FIXTURE");
  return d ? d : "";
}

at::Tensor logits_of(Model& m, ParallelEngine& e) {
  at::NoGradGuard ng;
  e.pre_model_forward();
  auto tokens = at::arange(8, at::kLong).unsqueeze(0);
  auto pos = at::arange(8, at::kLong).unsqueeze(0);
  return m.forward(tokens, pos);
}

}  // namespace

TEST_CASE("optimizer before wrapping, parameters rebuilt after wrapping, weights loaded by name") {
  REQUIRE(!fixture().empty());
  for (int strategy = 0; strategy <= 3; ++strategy) {
    INFO("zero_dp_strategy " << strategy);
    Config cfg = load_config_string("model: {path: " + fixture() + "/gpt.pt}\ndata: {train: " + fixture() +
                                        "/licenses}\ndistributed: {zero_dp_strategy: " + std::to_string(strategy) +
                                        "}\ntraining: {global_batch_size: 4, micro_batch_size: 1}\n",
                                    "t.yaml");
    auto optimizer = make_optimizer(cfg.optimizer);  // built before the model is wrapped
    MeshShape shape = resolve_mesh_shape(cfg, MpiEnv::world_size());
    DeviceMesh mesh(shape, MpiEnv::world_rank());
    ProcessGroups pg(mesh, Backend::kMpi);
    Model model = Model::load(cfg.model.path);
    model.find_units(std::nullopt, "t.yaml");
    auto engine = make_engine(model, cfg, pg);
    CHECK(logits_of(model, *engine).abs().max().item<float>() > 0);

    // Rebuild ln_f's parameters on the module, as a weight loader would: new tensor objects.
    torch::jit::Module ln_f = submodule_at(model.module(), "ln_f");
    ln_f.register_parameter("weight", at::zeros({64}).set_requires_grad(true), false);
    ln_f.register_parameter("bias", at::zeros({64}).set_requires_grad(true), false);
    CHECK(engine->rebind_parameters() == 2);
    // The engine's own (sharded) parameter is back on the module, holding the new values.
    int ln_w = -1;
    for (size_t i = 0; i < model.params().size(); ++i)
      if (model.params()[i].name == "ln_f.weight") ln_w = int(i);
    REQUIRE(ln_w >= 0);
    CHECK(ln_f.attr("weight").toTensor().is_same(model.params()[ln_w].tensor));
    // ln_f = 0 makes every logit 0: the new values reached every rank's gathered weights.
    CHECK(logits_of(model, *engine).abs().max().item<float>() == 0.0f);

    // One training step through the hooks and the optimizer registered after wrapping.
    engine->start_step();
    engine->start_micro_batch(true);
    engine->pre_model_forward();
    auto tokens = at::arange(16, at::kLong).remainder(200).unsqueeze(0);
    auto logits = model.forward(tokens.slice(1, 0, 15), at::arange(15, at::kLong).unsqueeze(0));
    auto loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(2)}), tokens.slice(1, 1, 16).reshape({-1}));
    loss.backward();
    engine->end_micro_batch();
    engine->finish_grad_sync(1.0);
    CHECK(engine->grad_norm().item<double>() > 0);
    {
      at::NoGradGuard ng;
      optimizer->step(engine->slots(), 1e-2);
      engine->install_weights();
    }
    CHECK(optimizer->steps_taken() == 1);
    CHECK(logits_of(model, *engine).abs().max().item<float>() > 0);  // ln_f.bias learned

    // Full weights by name: zero ln_f.bias and weight again.
    engine->load_full_weights({{"ln_f.weight", at::zeros({64})}, {"ln_f.bias", at::zeros({64})}});
    CHECK(logits_of(model, *engine).abs().max().item<float>() == 0.0f);
  }
}
