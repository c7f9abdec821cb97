// Pipeline stages and the engine that runs one stage's action list over the Communicator's point-to-point
// operations (pipeline.hpp). The action lists and their deadlock-free execution rules: pipeline_schedule.hpp.
#include <accel/errors.hpp>
#include <accel/parallel/pipeline.hpp>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>

namespace accel::pipeline {
namespace wire {
/// Which step the stages run; part of every header, so that stages calling different methods fail at once.
enum Mode : std::int64_t { kTrain = 0, kEvaluate = 1, kEvaluateLoss = 2 };
}  // namespace wire
using namespace wire;
namespace {

// The header before every message: one int64 tensor of kHeaderLength elements. An abort header carries the
// failing stage and the length of its message (sent next, as bytes) in the dtype and ndim fields.
enum HeaderField { kKind, kMicroBatch, kMicroBatches, kMode, kDtype, kNdim, kDims };
constexpr int kMaxDims = 8;
constexpr int kHeaderLength = kDims + kMaxDims;
constexpr int kAbortStage = kDtype, kAbortLength = kNdim;
constexpr std::int64_t kTensorMessage = 1, kAbortMessage = 2;
constexpr std::size_t kMaxAbortText = 4096;

const char* mode_name(std::int64_t mode) {
  switch (mode) {
    case kTrain:
      return "train_step";
    case kEvaluate:
      return "evaluate";
    case kEvaluateLoss:
      return "evaluate with a loss";
  }
  return "unknown step";
}

// Between two neighbours only one kind of message flows each way (activations to s + 1, gradients to s - 1),
// and the receiver matches (source, tag): one header stream, one abort-text stream, data tags by micro-batch.
constexpr int kHeaderTag = 0, kAbortTag = 1, kDataTag = 2;
constexpr int kMaxMicroBatches = 1 << 20;

int data_tag(int micro_batch) {
  return kDataTag + micro_batch;
}

// A header of `kind` about `micro_batch` of `micro_batches`, its other fields zero.
torch::Tensor new_header(std::int64_t kind, int micro_batch, int micro_batches) {
  auto header = torch::zeros({kHeaderLength}, torch::kInt64);
  auto* h = header.data_ptr<std::int64_t>();
  h[kKind] = kind;
  h[kMicroBatch] = micro_batch;
  h[kMicroBatches] = micro_batches;
  return header;
}

std::string shape(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// A neighbour's abort message: the stage that failed first, its micro-batch and its error.
class RemoteFailure : public DistributedError {
 public:
  RemoteFailure(int from, int origin, int micro_batch, const std::string& text)
      : DistributedError(text), from(from), origin(origin), micro_batch(micro_batch) {}
  int from, origin, micro_batch;
};

void check_layer_count(int layers) {
  if (layers < 1) {
    throw UsageError(
        fmt::format("pipeline: a model of {} layers cannot be split into stages; give it layers", layers));
  }
}

void check_stage(int stage, int stages) {
  if (stage < 0 || stage >= stages) {
    throw UsageError(fmt::format(
        "pipeline: stage {} is outside [0, {}); pass this rank's stage index (its rank)", stage, stages));
  }
}

}  // namespace

std::vector<int> partition_model(const torch::nn::Sequential& model, int stages,
                                 const PartitionMethod& method) {
  check_layer_count(static_cast<int>(model->size()));
  std::vector<std::int64_t> counts;
  std::vector<std::string> names;
  for (const auto& layer : *model) {
    std::int64_t count = 0;
    for (const auto& p : layer.ptr()->parameters())
      count += p.numel();
    counts.push_back(count);
    names.push_back(layer.ptr()->name());
  }
  return partition(method, counts, names, stages);
}

PipelineStage::PipelineStage(const torch::nn::Sequential& model, int stage, int stages,
                             const PartitionMethod& method)
    : stage_(stage), boundaries_(partition_model(model, stages, method)) {
  check_stage(stage, stages);
  const auto begin = model->begin();
  for (int i = boundaries_[static_cast<std::size_t>(stage)];
       i < boundaries_[static_cast<std::size_t>(stage) + 1]; ++i)
    layers_->push_back(std::to_string(i), *(begin + i));
  // Ties: one parameter tensor at several places of the whole model, held by more than one stage.
  std::map<const void*, Tie> shared;
  std::vector<const void*> order;
  for (int i = 0; i < static_cast<int>(model->size()); ++i) {
    const int holder = static_cast<int>(std::upper_bound(boundaries_.begin(), boundaries_.end(), i) -
                                        boundaries_.begin() - 1);
    for (const auto& item : (begin + i)->ptr()->named_parameters()) {
      const void* key = item.value().unsafeGetTensorImpl();
      auto [it, fresh] = shared.try_emplace(key);
      if (fresh) order.push_back(key);
      it->second.names.push_back(fmt::format("{}.{}", i, item.key()));
      if (it->second.stages.empty() || it->second.stages.back() != holder)
        it->second.stages.push_back(holder);
    }
  }
  for (const void* key : order) {
    if (shared[key].stages.size() > 1) ties_.push_back(std::move(shared[key]));
  }
  // What the other stages train: every tensor of the whole model that none of this stage's layers uses.
  cut_from_model_ = true;
  std::set<const void*> seen;
  for (const auto& t : layers_->parameters())
    seen.insert(t.unsafeGetTensorImpl());
  for (const auto& t : layers_->buffers())
    seen.insert(t.unsafeGetTensorImpl());
  for (int i = 0; i < static_cast<int>(model->size()); ++i) {
    auto layer = (begin + i)->ptr();
    auto add = [&](const std::string& name, const torch::Tensor& t) {
      if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second)
        foreign_.emplace_back(fmt::format("{}.{}", i, name), t);
    };
    for (const auto& item : layer->named_parameters())
      add(item.key(), item.value());
    for (const auto& item : layer->named_buffers())
      add(item.key(), item.value());
  }
}

void PipelineStage::poison_foreign(const std::function<std::string(const std::string& name)>& message) {
  for (const auto& [name, t] : foreign_) {
    if (t.has_storage())
      t.storage().unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(message(name));
  }
}

void PipelineStage::restore_foreign(const std::map<std::string, torch::Tensor>& whole) {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : foreign_) {
    const auto it = whole.find(name);
    if (it == whole.end() || it->second.sizes() != t.sizes()) continue;
    // Fresh memory for the tensor object (its autograd metadata and every handle to it stay): the poisoned
    // storage goes with its last user.
    t.set_data(it->second.detach().to(t.device(), t.scalar_type()).clone());
  }
}

std::string PipelineStage::Tie::name_on(int stage, const std::vector<int>& boundaries) const {
  for (const auto& name : names) {
    const int layer = std::stoi(name.substr(0, name.find('.')));
    if (layer >= boundaries[static_cast<std::size_t>(stage)] &&
        layer < boundaries[static_cast<std::size_t>(stage) + 1])
      return name;
  }
  return {};
}

torch::Tensor PipelineStage::tied_parameter(const Tie& tie) const {
  const auto name = tie.name_on(stage_, boundaries_);
  if (name.empty()) return {};
  return layers_->named_parameters()[name];
}

PipelineStage::PipelineStage(const std::function<torch::nn::AnyModule(int layer)>& make_layer, int layers,
                             int stage, int stages, std::vector<int> boundaries)
    : stage_(stage) {
  check_layer_count(layers);
  boundaries_ = boundaries.empty() ? partition_uniform(layers, stages)
                                   : partition_explicit(std::move(boundaries), layers, stages);
  check_stage(stage, stages);
  for (int i = boundaries_[static_cast<std::size_t>(stage)];
       i < boundaries_[static_cast<std::size_t>(stage) + 1]; ++i) {
    auto layer = make_layer(i);
    if (layer.is_empty()) {
      throw UsageError(
          fmt::format("pipeline stage {}: make_layer({}) returned an empty AnyModule; return the "
                      "layer, e.g. torch::nn::AnyModule(torch::nn::Linear(8, 16))",
                      stage, i));
    }
    layers_->push_back(std::to_string(i), std::move(layer));
  }
}

namespace {

// A layer of a stage threw: its global index and what it said.
struct LayerFailure : std::runtime_error {
  LayerFailure(int layer, const std::string& what) : std::runtime_error(what), layer(layer) {}
  int layer;
};

}  // namespace

torch::Tensor PipelineStage::forward(const torch::Tensor& input) {
  // Sequential::forward, one layer at a time, so that a failure names the layer that failed.
  const int first = boundaries()[static_cast<std::size_t>(stage())];
  torch::nn::AnyValue value(input);
  int layer = first;
  for (auto& module : *layers_) {
    try {
      value = module.any_forward(std::move(value));
    } catch (const std::exception& e) {
      throw LayerFailure(layer, e.what());
    }
    ++layer;
  }
  return value.get<torch::Tensor>();
}

std::vector<torch::Tensor> PipelineStage::parameters() const {
  return layers_->parameters();
}

torch::OrderedDict<std::string, torch::Tensor> PipelineStage::named_parameters() const {
  return layers_->named_parameters();  // the layers are registered under their global index
}

// ---- engine ----

struct PipelineEngine::Step {
  /// One micro-batch's tensors on this stage, from its forward to its backward (or its send, in evaluation).
  struct Slot {
    torch::Tensor input, output, loss, grad;
  };
  explicit Step(Mode m) : mode(m) {}
  Mode mode;
  const LossFunction* loss = nullptr;  ///< the last stage computes losses (train_step, evaluate with a loss)
  torch::Device device{torch::kCPU};
  std::vector<torch::Tensor> inputs, targets;  ///< micro-batches (stage 0, last stage)
  std::map<int, Slot> slots;
  int live = 0;       ///< micro-batches forwarded and not yet backwarded
  int backwards = 0;  ///< Backward actions run so far
  std::vector<std::unique_ptr<CollectiveHandle>> sends;
  /// Training: the sends of each micro-batch's activation, waited on (and their buffers released) once the
  /// next stage's gradient of that micro-batch arrived, which it sends only after it received the activation.
  std::map<int, std::vector<std::unique_ptr<CollectiveHandle>>> activation_sends;

  /// Every send still pending, moved out of the step.
  std::vector<std::unique_ptr<CollectiveHandle>> take_sends() {
    auto out = std::move(sends);
    sends.clear();
    for (auto& [mb, handles] : activation_sends) {
      for (auto& h : handles)
        out.push_back(std::move(h));
    }
    activation_sends.clear();
    return out;
  }
  std::vector<double> losses;
  std::vector<torch::Tensor> outputs;  ///< evaluate on the last stage
};

PipelineEngine::PipelineEngine(PipelineStage& stage, std::shared_ptr<Communicator> comm, Schedule schedule,
                               int micro_batches)
    : stage_(stage), comm_(std::move(comm)), schedule_(schedule), micro_batches_(micro_batches) {
  if (!comm_) throw UsageError("pipeline: the engine needs a communicator; pass Communicator::create(...)");
  if (stage_.stage() != comm_->rank() || stage_.stages() != comm_->world_size()) {
    throw UsageError(
        fmt::format("pipeline: rank {} of {} was given stage {} of {}; the pipeline spans every rank, rank r "
                    "running stage r: build the stage with PipelineStage(model, comm->rank(), "
                    "comm->world_size())",
                    comm_->rank(), comm_->world_size(), stage_.stage(), stage_.stages()));
  }
  if (micro_batches < 1 || micro_batches > kMaxMicroBatches) {
    throw ConfigError(
        fmt::format("pipeline: {} micro-batches is not valid; use 1 to {} (at least the number of "
                    "stages keeps the bubble small)",
                    micro_batches, kMaxMicroBatches));
  }
  // One group per tie: the stages holding the tied parameter (split is collective over the pipeline, and
  // every stage knows every tie: each rank built the whole model).
  for (const auto& tie : stage_.ties()) {
    std::vector<std::vector<int>> groups{tie.stages};
    for (int r = 0; r < comm_->world_size(); ++r) {
      if (!std::binary_search(tie.stages.begin(), tie.stages.end(), r)) groups.push_back({r});
    }
    tie_comms_.push_back(comm_->split(groups));
  }
}

double PipelineEngine::train_step(const torch::Tensor& inputs, const torch::Tensor& targets,
                                  const LossFunction& loss) {
  Step step(kTrain);
  step.loss = &loss;
  peak_live_ = 0;
  stats_ = {};
  const double mean = run(step, inputs, targets);
  reduce_ties();
  return mean;
}

void PipelineEngine::reduce_ties() {
  const auto& ties = stage_.ties();
  for (std::size_t i = 0; i < ties.size(); ++i) {
    auto t = stage_.tied_parameter(ties[i]);
    if (!t.defined()) continue;  // this stage holds no copy
    torch::NoGradGuard no_grad;
    auto& grad = t.mutable_grad();
    if (!grad.defined()) grad = torch::zeros_like(t);
    tie_comms_[i]->all_reduce(grad, ReduceOp::Sum);
  }
}

torch::Tensor PipelineEngine::evaluate(const torch::Tensor& inputs) {
  Step step(kEvaluate);
  run(step, inputs, {});
  return stage_.stage() == stage_.stages() - 1 ? torch::cat(step.outputs) : torch::Tensor();
}

double PipelineEngine::evaluate(const torch::Tensor& inputs, const torch::Tensor& targets,
                                const LossFunction& loss) {
  Step step(kEvaluateLoss);
  step.loss = &loss;
  return run(step, inputs, targets);
}

namespace {

// `t` (inputs or targets, `name`) split into `m` micro-batches along dim 0, on stage `s`.
std::vector<torch::Tensor> split_micro_batches(const torch::Tensor& t, const char* name, int s, int m) {
  if (!t.defined() || t.dim() == 0) {
    throw UsageError(fmt::format("{} must be a tensor with the batch along dim 0 on stage {}; got {}", name,
                                 s, t.defined() ? "a 0-dim tensor" : "an undefined tensor"));
  }
  if (t.size(0) % m != 0) {
    throw UsageError(
        fmt::format("{} of shape {} do not split into {} equal micro-batches along dim 0; use a "
                    "batch size that is a multiple of micro_batches ({})",
                    name, shape(t.sizes()), m, m));
  }
  return t.chunk(m, 0);
}

}  // namespace

double PipelineEngine::run(Step& step, const torch::Tensor& inputs, const torch::Tensor& targets) {
  const int s = stage_.stage(), last = stage_.stages() - 1, m = micro_batches_;
  if (!failed_.empty()) {
    throw UsageError(
        fmt::format("pipeline stage {}: an earlier step failed ({}); the stages' message streams "
                    "are out of step, so no further step can run: restart the processes",
                    s, failed_));
  }
  const auto params = stage_.parameters();
  if (!params.empty()) step.device = params.front().device();
  const auto actions = step.mode == kTrain
                           ? make_schedule(schedule_, last + 1, m)[static_cast<std::size_t>(s)]
                           : make_forward_only_schedule(last + 1, m)[static_cast<std::size_t>(s)];
  std::optional<Action> current;
  try {
    if (s == 0) step.inputs = split_micro_batches(inputs, "inputs", s, m);
    if (s == last && step.loss) {
      if (!*step.loss) throw UsageError("the last stage needs a loss function; pass one to train_step");
      step.targets = split_micro_batches(targets, "targets", s, m);
    }
    run_actions(actions, step, current);
  } catch (const std::exception& e) {
    fail_step(e, step, current);
  }
  if (!step.loss) return 0;
  double mean = 0;
  for (double l : step.losses)
    mean += l / m;
  auto value = torch::full({1}, mean, torch::kFloat64);
  comm_->broadcast(value, last);
  return value.item<double>();
}

void PipelineEngine::run_actions(const std::vector<Action>& actions, Step& step,
                                 std::optional<Action>& current) {
  using Clock = std::chrono::steady_clock;
  const auto step_start = Clock::now();
  for (const Action& action : actions) {
    current = action;
    const auto start = Clock::now();
    execute(action, step);
    if (step.mode != kTrain) continue;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (action.type == ActionType::Forward || action.type == ActionType::Backward)
      stats_.compute_s += seconds;
    else if (action.type == ActionType::RecvActivation || action.type == ActionType::RecvGrad ||
             action.type == ActionType::WaitSends)
      stats_.wait_s += seconds;
  }
  if (step.mode == kTrain) {
    stats_.step_s = std::chrono::duration<double>(Clock::now() - step_start).count();
    stats_.peak_live = peak_live_;
  }
}

void PipelineEngine::fail_step(const std::exception& e, Step& step, const std::optional<Action>& current) {
  const int s = stage_.stage(), last = stage_.stages() - 1;
  // Tell the neighbours (except the one the failure came from), so that every rank fails instead of
  // waiting.
  const auto* remote = dynamic_cast<const RemoteFailure*>(&e);
  const std::string where = current ? to_string(*current) : "the start of the step";
  const std::string text =
      remote ? remote->what() : fmt::format("pipeline stage {} failed at {}: {}", s, where, message_of(e));
  const int origin = remote ? remote->origin : s;
  const int micro_batch = remote ? remote->micro_batch : current ? current->micro_batch : -1;
  for (int peer : {s - 1, s + 1}) {
    if (peer >= 0 && peer <= last && !(remote && remote->from == peer))
      send_abort(peer, origin, micro_batch, text);
  }
  // Pending sends stay alive with the engine: their buffers must not go away under the transport.
  for (auto& h : step.take_sends())
    kept_sends_.push_back(std::move(h));
  failed_ = text;
  if (remote)
    throw DistributedError(fmt::format("pipeline stage {} stopped at {} because {}", s, where, text));
  if (dynamic_cast<const DistributedError*>(&e)) throw DistributedError(text);
  if (dynamic_cast<const ConfigError*>(&e)) throw ConfigError(text);
  throw UsageError(text);
}

void PipelineEngine::execute(const Action& a, Step& step) {
  const int mb = a.micro_batch;
  const bool train = step.mode == kTrain;
  switch (a.type) {
    case ActionType::Forward:
      forward(mb, step);
      break;
    case ActionType::Backward:
      backward(mb, step);
      break;
    case ActionType::SendActivation: {
      auto& slot = step.slots.at(mb);
      send_tensor(slot.output.detach().contiguous(), a.peer_stage, mb, step.mode,
                  train ? step.activation_sends[mb] : step.sends);
      if (!train) step.slots.erase(mb);
      break;
    }
    case ActionType::RecvActivation:
      step.slots[mb].input = recv_tensor(step, a.peer_stage, mb, nullptr);
      break;
    case ActionType::SendGrad: {
      auto& slot = step.slots.at(mb);
      // An input the stage's output does not depend on has no gradient: its gradient is zero.
      auto grad = slot.input.grad();
      send_tensor(grad.defined() ? grad.contiguous() : torch::zeros_like(slot.input), a.peer_stage, mb,
                  step.mode, step.sends);
      step.slots.erase(mb);
      --step.live;
      break;
    }
    case ActionType::RecvGrad: {
      auto& slot = step.slots.at(mb);
      slot.grad = recv_tensor(step, a.peer_stage, mb, &slot.output);
      // The gradient of micro-batch mb arrived, so the next stage had received its activation: that send is
      // complete, and waiting on it releases the buffer now instead of at the end of the step.
      if (auto it = step.activation_sends.find(mb); it != step.activation_sends.end()) {
        for (auto& h : it->second)
          h->wait();
        step.activation_sends.erase(it);
      }
      break;
    }
    case ActionType::WaitSends:
      for (auto& h : step.take_sends())
        h->wait();
      break;
  }
}

void PipelineEngine::forward(int mb, Step& step) {
  const int s = stage_.stage(), last = stage_.stages() - 1;
  const bool train = step.mode == kTrain;
  auto& slot = step.slots[mb];
  if (s == 0) slot.input = step.inputs[static_cast<std::size_t>(mb)];
  if (s > 0 && train && slot.input.is_floating_point()) slot.input.requires_grad_(true);
  const torch::Tensor out = forward_layers(slot.input, train);
  if (s == last) {
    if (step.loss) {
      auto l = micro_batch_loss(step, mb, out);
      if (train) slot.loss = l;
    }
    if (step.mode == kEvaluate) step.outputs.push_back(out);
  }
  if (!train) {
    if (s == last)
      step.slots.erase(mb);
    else
      slot.output = out;
    return;
  }
  slot.output = out;
  peak_live_ = std::max(peak_live_, ++step.live);
  std::int64_t held = 0;  // the boundary tensors kept for backward
  for (const auto& entry : step.slots) {
    for (const auto* t : {&entry.second.input, &entry.second.output})
      if (t->defined()) held += static_cast<std::int64_t>(t->nbytes());
  }
  stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, held);
}

torch::Tensor PipelineEngine::forward_layers(const torch::Tensor& input, bool train) {
  const int s = stage_.stage();
  std::optional<torch::NoGradGuard> no_grad;
  if (!train) no_grad.emplace();
  const int first = stage_.boundaries()[static_cast<std::size_t>(s)];
  const int last = stage_.boundaries()[static_cast<std::size_t>(s) + 1] - 1;
  const std::string fed =
      s == 0 ? "the micro-batch of the inputs" : fmt::format("the output of stage {}", s - 1);
  try {
    return stage_.forward(input);
  } catch (const LayerFailure& e) {
    throw UsageError(fmt::format(
        "layer {} (of this stage's layers {} to {}) threw, on {} of shape {}{}: {}; check that layer {} "
        "takes one tensor and fits {}",
        e.layer, first, last, fed, shape(input.sizes()),
        e.layer == first ? "" : fmt::format(" passed through layers {} to {}", first, e.layer - 1),
        message_of(e), e.layer, e.layer == first ? fed : fmt::format("the output of layer {}", e.layer - 1)));
  } catch (const std::exception& e) {
    throw UsageError(fmt::format("layers {} to {} threw on {} of shape {}: {}", first, last, fed,
                                 shape(input.sizes()), message_of(e)));
  }
}

torch::Tensor PipelineEngine::micro_batch_loss(Step& step, int mb, const torch::Tensor& out) {
  auto l = (*step.loss)(out, step.targets[static_cast<std::size_t>(mb)]);
  if (!l.defined() || l.numel() != 1) {
    throw UsageError(
        fmt::format("the loss function returned {}; return one value per micro-batch (e.g. "
                    "a mean over its rows)",
                    l.defined() ? "shape " + shape(l.sizes()) : "an undefined tensor"));
  }
  step.losses.push_back(l.item<double>());
  return l;
}

void PipelineEngine::backward(int mb, Step& step) {
  const int s = stage_.stage(), last = stage_.stages() - 1;
  auto& slot = step.slots.at(mb);
  const bool final_backward = ++step.backwards == micro_batches_;
  if (hooks_.before) hooks_.before(final_backward);
  if (s == last) {
    const double scale = hooks_.loss_scale ? hooks_.loss_scale() : 1.0;
    if (slot.loss.requires_grad()) torch::autograd::backward({slot.loss * (scale / micro_batches_)});
  } else if (slot.output.requires_grad()) {
    torch::autograd::backward({slot.output}, {slot.grad});
  }
  if (hooks_.after) hooks_.after(final_backward);
  slot.output = slot.loss = slot.grad = torch::Tensor();
  if (s == 0) {
    step.slots.erase(mb);
    --step.live;
  }
}

void PipelineEngine::send_tensor(const torch::Tensor& tensor, int peer, int micro_batch, std::int64_t mode,
                                 std::vector<std::unique_ptr<CollectiveHandle>>& into) {
  if (tensor.dim() > kMaxDims) {
    throw UsageError(
        fmt::format("the tensor for stage {} has shape {}: at most {} dimensions cross stages; "
                    "reshape it",
                    peer, shape(tensor.sizes()), kMaxDims));
  }
  auto header = new_header(kTensorMessage, micro_batch, micro_batches_);
  auto* h = header.data_ptr<std::int64_t>();
  h[kMode] = mode;
  h[kDtype] = static_cast<std::int64_t>(tensor.scalar_type());
  h[kNdim] = tensor.dim();
  for (std::int64_t d = 0; d < tensor.dim(); ++d)
    h[kDims + d] = tensor.size(d);
  into.push_back(comm_->send_async(header, peer, kHeaderTag));
  if (tensor.numel() > 0) into.push_back(comm_->send_async(tensor, peer, data_tag(micro_batch)));
}

torch::Tensor PipelineEngine::recv_tensor(Step& step, int peer, int micro_batch, const torch::Tensor* like) {
  auto header = torch::empty({kHeaderLength}, torch::kInt64);
  comm_->recv_async(header, peer, kHeaderTag)->wait();
  const auto* h = header.data_ptr<std::int64_t>();
  const char* what = like ? "gradient" : "activation";
  if (h[kKind] == kAbortMessage) {
    const auto length = std::clamp<std::int64_t>(h[kAbortLength], 0, kMaxAbortText);
    auto text = torch::empty({length}, torch::kUInt8);
    if (length > 0) comm_->recv_async(text, peer, kAbortTag)->wait();
    throw RemoteFailure(peer, static_cast<int>(h[kAbortStage]), static_cast<int>(h[kMicroBatch]),
                        std::string(reinterpret_cast<const char*>(text.data_ptr<std::uint8_t>()),
                                    static_cast<std::size_t>(length)));
  }
  if (h[kKind] != kTensorMessage || h[kNdim] < 0 || h[kNdim] > kMaxDims || h[kDtype] < 0 ||
      h[kDtype] >= static_cast<std::int64_t>(c10::ScalarType::NumOptions)) {
    throw DistributedError(
        fmt::format("stage {} sent a malformed {} header [{}]; is another program using tags "
                    "below 2^30 between these ranks?",
                    peer, what, fmt::join(h, h + kHeaderLength, ", ")));
  }
  if (h[kMicroBatches] != micro_batches_ || h[kMode] != step.mode) {
    throw DistributedError(
        fmt::format("stage {} runs {} over {} micro-batches, this stage {} over {}; every rank "
                    "must call the same engine method with the same micro_batches",
                    peer, mode_name(h[kMode]), h[kMicroBatches], mode_name(step.mode), micro_batches_));
  }
  if (h[kMicroBatch] != micro_batch) {
    throw DistributedError(
        fmt::format("stage {} sent the {} of micro-batch {} where this stage expects "
                    "micro-batch {}; every rank must run the same schedule",
                    peer, what, h[kMicroBatch], micro_batch));
  }
  const std::vector<std::int64_t> sizes(h + kDims, h + kDims + h[kNdim]);
  const auto dtype = static_cast<c10::ScalarType>(h[kDtype]);
  if (like && (!like->sizes().equals(sizes) || dtype != like->scalar_type())) {
    throw DistributedError(
        fmt::format("the gradient from stage {} has shape {} ({}), the activation it belongs "
                    "to {} ({}); the stages disagree about micro-batch {}",
                    peer, shape(sizes), c10::toString(dtype), shape(like->sizes()),
                    c10::toString(like->scalar_type()), micro_batch));
  }
  auto tensor = torch::empty(sizes, torch::TensorOptions().dtype(dtype).device(step.device));
  if (tensor.numel() > 0) comm_->recv_async(tensor, peer, data_tag(micro_batch))->wait();
  return tensor;
}

void PipelineEngine::send_abort(int peer, int stage, int micro_batch, const std::string& message) {
  const auto text = message.substr(0, kMaxAbortText);
  auto header = new_header(kAbortMessage, micro_batch, micro_batches_);
  auto* h = header.data_ptr<std::int64_t>();
  h[kAbortStage] = stage;
  h[kAbortLength] = static_cast<std::int64_t>(text.size());
  auto bytes = torch::empty({static_cast<std::int64_t>(text.size())}, torch::kUInt8);
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(bytes.data_ptr<std::uint8_t>()));
  try {
    kept_sends_.push_back(comm_->send_async(header, peer, kHeaderTag));
    if (!text.empty()) kept_sends_.push_back(comm_->send_async(bytes, peer, kAbortTag));
  } catch (const std::exception&) {
    // The original error is what the caller needs; a peer we cannot reach fails on its own timeout.
  }
}

}  // namespace accel::pipeline
