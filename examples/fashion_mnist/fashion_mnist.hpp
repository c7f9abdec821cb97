#pragma once
// Fashion-MNIST from the Debian package `dataset-fashion-mnist` (/usr/share/datasets/fashion-mnist/*.gz, the
// original IDX files, gzip-compressed), a small CNN, and the command line shared by both versions of the
// example.

#include <torch/torch.h>
#include <zlib.h>

#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

namespace fashion {

inline std::string default_data_dir() {
  const char* env = std::getenv("FASHION_MNIST_DIR");
  return env != nullptr ? env : "/usr/share/datasets/fashion-mnist";
}

inline std::string read_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw std::runtime_error("cannot open " + path +
                             ": install the Debian package dataset-fashion-mnist or set "
                             "FASHION_MNIST_DIR");
  }
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0)
    out.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  if (n < 0) throw std::runtime_error("corrupt gzip file " + path);
  return out;
}

inline std::uint32_t be32(const std::string& s, std::size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data() + at);
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}

/// The train or test split as tensors: images [N,1,28,28] float normalised, labels [N] int64.
class Dataset : public torch::data::datasets::Dataset<Dataset> {
 public:
  Dataset(const std::string& dir, bool train, std::int64_t limit = 0) {
    const std::string prefix = dir + (train ? "/train" : "/t10k");
    const auto images = read_gz(prefix + "-images-idx3-ubyte.gz");
    const auto labels = read_gz(prefix + "-labels-idx1-ubyte.gz");
    if (be32(images, 0) != 2051 || be32(labels, 0) != 2049)
      throw std::runtime_error("bad IDX magic in " + prefix);
    std::int64_t n = be32(images, 4);
    if (limit > 0 && limit < n) n = limit;
    images_ = torch::from_blob(const_cast<char*>(images.data() + 16), {n, 1, 28, 28}, torch::kUInt8)
                  .to(torch::kFloat32)
                  .div_(255.0)
                  .sub_(0.2860)
                  .div_(0.3530);
    labels_ = torch::from_blob(const_cast<char*>(labels.data() + 8), {n}, torch::kUInt8).to(torch::kInt64);
  }
  torch::data::Example<> get(std::size_t i) override {
    return {images_[static_cast<std::int64_t>(i)], labels_[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(images_.size(0)); }

 private:
  torch::Tensor images_, labels_;
};

struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 5 * 5, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

struct Args {
  int epochs = 2;
  std::size_t batch_size = 64;
  double lr = 1e-3;
  std::int64_t train_limit = 0;  // 0: all 60000
  std::int64_t test_limit = 0;   // 0: all 10000
  std::string data_dir = default_data_dir();
  std::string save_dir;  // accelerated version: save_state here at the end
  // accelerated version: experiment trackers ("none" disables) writing into <log_dir>/fashion_mnist
  std::string log_with = "tensorboard";
  std::string log_dir = "runs";
};

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--epochs")
      a.epochs = std::stoi(next());
    else if (k == "--batch-size")
      a.batch_size = std::stoul(next());
    else if (k == "--lr")
      a.lr = std::stod(next());
    else if (k == "--train-limit")
      a.train_limit = std::stoll(next());
    else if (k == "--test-limit")
      a.test_limit = std::stoll(next());
    else if (k == "--data")
      a.data_dir = next();
    else if (k == "--save")
      a.save_dir = next();
    else if (k == "--log-with")
      a.log_with = next();
    else if (k == "--log-dir")
      a.log_dir = next();
    else {
      throw std::invalid_argument(
          "unknown argument " + k +
          "; use --epochs N --batch-size B --lr X --train-limit N --test-limit N --data DIR "
          "--save DIR --log-with tensorboard|csv|jsonl|all|none --log-dir DIR");
    }
  }
  return a;
}

}  // namespace fashion
