// A GAN on Fashion-MNIST with accelerate-cpp: plain.cpp plus a few lines, with two models and two optimizers
// prepared together. Runs as one process, or on many ranks under accel-launch (DDP, ZeRO, FSDP by YAML).
#include <accel/accelerator/accelerator.hpp>

#include <filesystem>

#include "gan.hpp"

int main(int argc, char** argv) try {
  const auto args = gan::parse_args(argc, argv);
  torch::manual_seed(args.seed);
  gan::Generator G;
  gan::Discriminator D;
  const auto adam = torch::optim::AdamOptions(args.lr).betas({0.5, 0.999});
  torch::optim::Adam opt_g(G->parameters(), adam);
  torch::optim::Adam opt_d(D->parameters(), adam);
  accel::Accelerator accelerator;
  accelerator.prepare(G, D, opt_g, opt_d);
  auto train =
      fashion::Dataset(args.data_dir, true, args.train_limit).map(torch::data::transforms::Stack<>());
  auto loader = accelerator.prepare_data_loader<torch::data::samplers::SequentialSampler>(std::move(train),
                                                                                          args.batch_size);
  auto bce = [](const torch::Tensor& logits, double label) {
    return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, label));
  };

  std::uint64_t step = 0;  // global batch index, over all epochs
  torch::Tensor d_loss, g_loss;
  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    auto d_sum = torch::zeros({}, accelerator.device()), g_sum = torch::zeros({}, accelerator.device());
    std::int64_t batches = 0;
    for (auto& batch : *loader) {
      const auto real = batch.data.flatten(1);
      const auto rows = real.size(0);
      // Noise of global batch `step` from a generator seeded by (--seed, step): every process draws the noise
      // of the whole global batch and takes its own rows, so N ranks with batch B draw what one process with
      // batch N*B draws (see gan::noise).
      auto [z, z2] = gan::noise(args.seed, step++, args.batch_size, rows, accelerator.process_index(),
                                accelerator.num_processes(), accelerator.device());

      opt_d.zero_grad();
      d_loss = bce(D(real), 1) + bce(D(G(z).detach()), 0);
      accelerator.backward(d_loss);
      opt_d.step();

      opt_g.zero_grad();
      g_loss = bce(D(G(z2)), 1);  // D gets gradients too; opt_d.zero_grad() clears them before D's next step
      accelerator.backward(g_loss);
      opt_g.step();

      d_sum += d_loss.detach();
      g_sum += g_loss.detach();
      ++batches;
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    const auto d_mean = accelerator.reduce(d_sum / batches, accel::ReduceOp::Mean),
               g_mean = accelerator.reduce(g_sum / batches, accel::ReduceOp::Mean);
    accelerator.print("epoch ", epoch, ": d_loss ", gan::g6(d_mean), " g_loss ", gan::g6(g_mean), " (",
                      gan::g6(took.count()), " s)");
  }

  const auto d_last = accelerator.reduce(d_loss.detach(), accel::ReduceOp::Mean),
             g_last = accelerator.reduce(g_loss.detach(), accel::ReduceOp::Mean);
  accelerator.print("final d_loss ", gan::g6(d_last), " g_loss ", gan::g6(g_last));
  const auto g_weights = accelerator.get_state_dict(G);  // whole weights on every rank (collective)
  const auto d_weights = accelerator.get_state_dict(D);
  accelerator.print("weight checksum G=", gan::g6(gan::abs_sum(g_weights)),
                    " D=", gan::g6(gan::abs_sum(d_weights)));
  accelerator.wait_for_everyone();
  if (!args.save_dir.empty() && accelerator.is_main_process()) {
    std::filesystem::create_directories(args.save_dir);
    // The whole weights, not G and D themselves: sharded backends keep only a slice of them at rest.
    torch::save(gan::with_weights<gan::Generator>(g_weights), args.save_dir + "/generator.pt");
    torch::save(gan::with_weights<gan::Discriminator>(d_weights), args.save_dir + "/discriminator.pt");
  }
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
