// model.trainable / model.frozen: which parameters a fine-tuning run trains (DESIGN.md section 13).
// A frozen parameter is a leaf that does not require grad: autograd computes no gradient for it
// (its inputs' gradients still flow through), and the engine gives it no gradient buffer, no
// optimizer state and no reduction, while it is still sharded like any other weight.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/model.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

bool matches(const std::string& glob, const ModelParam& p) {
  if (glob_match(glob, p.name)) return true;
  for (const auto& a : p.aliases)
    if (glob_match(glob, a)) return true;
  return false;
}

std::string some_names(const std::vector<ModelParam>& params) {
  std::vector<std::string> names;
  for (size_t i = 0; i < params.size() && i < 6; ++i) names.push_back(params[i].name);
  return join(names, ", ") + (params.size() > 6 ? fmt::format(", ... ({} in all)", params.size()) : "");
}

}  // namespace

std::vector<bool> Model::trainable_mask(const Config& cfg, std::string* source_out) const {
  const auto& mc = cfg.model;
  std::vector<bool> train(params_.size(), true);
  std::string source = "every parameter";
  if (mc.trainable) {
    source = "model.trainable";
    train.assign(params_.size(), false);
    for (const auto& glob : *mc.trainable) {
      bool any = false;
      for (size_t i = 0; i < params_.size(); ++i)
        if (matches(glob, params_[i])) train[i] = any = true;
      if (!any)
        throw ConfigError(fmt::format("{}: '{}' matches no parameter of {} (parameters are named like {})",
                                      cfg.where("model.trainable"), glob, path_, some_names(params_)));
    }
  } else if (!stored_trainable_.empty()) {
    source = path_ + "'s mfsdp/trainable.json (the exporter's trainable parameters; model.trainable overrides it)";
    nlohmann::json names;
    try {
      names = nlohmann::json::parse(stored_trainable_);
    } catch (const std::exception& e) {
      throw UserError(path_ + ": its mfsdp/trainable.json is not JSON: " + e.what());
    }
    if (!names.is_array()) throw UserError(path_ + ": its mfsdp/trainable.json must be a list of parameter names");
    train.assign(params_.size(), false);
    for (const auto& n : names) {
      if (!n.is_string()) throw UserError(path_ + ": its mfsdp/trainable.json must be a list of parameter names");
      bool any = false;
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].name == n.get<std::string>() ||
            std::find(params_[i].aliases.begin(), params_[i].aliases.end(), n.get<std::string>()) != params_[i].aliases.end())
          train[i] = any = true;
      if (!any) throw UserError(path_ + ": its mfsdp/trainable.json names " + n.get<std::string>() + ", which is no parameter");
    }
  }
  for (const auto& glob : mc.frozen) {
    bool any = false;
    for (size_t i = 0; i < params_.size(); ++i)
      if (matches(glob, params_[i])) {
        any = true;
        train[i] = false;
      }
    if (!any)
      throw ConfigError(fmt::format("{}: '{}' matches no parameter of {} (parameters are named like {})",
                                    cfg.where("model.frozen"), glob, path_, some_names(params_)));
  }
  if (source_out) *source_out = source;
  return train;
}

std::string Model::apply_trainable(const Config& cfg) {
  const auto& mc = cfg.model;
  std::string source;
  const std::vector<bool> train = trainable_mask(cfg, &source);
  int64_t n_train = 0, e_train = 0, e_all = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].frozen = !train[i];
    params_[i].tensor.set_requires_grad(train[i]);
    e_all += params_[i].global_numel();
    if (train[i]) {
      ++n_train;
      e_train += params_[i].global_numel();
    }
  }
  if (n_train == 0)
    throw ConfigError(fmt::format("{}: no parameter of {} is left to train (model.trainable, model.frozen)",
                                  cfg.where(mc.trainable ? "model.trainable" : "model.frozen"), path_));
  if (n_train == int64_t(params_.size())) return "";
  return fmt::format("trainable: {} of {} parameters, {} of {} elements ({:.2f}%), from {}{}", n_train, params_.size(),
                     e_train, e_all, 100.0 * double(e_train) / double(e_all), source,
                     mc.frozen.empty() ? "" : " less model.frozen");
}

}  // namespace mfsdp
