// A GAN on Fashion-MNIST with a plain LibTorch loop: two models, two optimizers, two backward passes per
// batch. The baseline that accelerated.cpp changes by a few lines.
#include "gan.hpp"

int main(int argc, char** argv) try {
  const auto args = gan::parse_args(argc, argv);
  torch::manual_seed(args.seed);
  gan::Generator G;
  gan::Discriminator D;
  const auto adam = torch::optim::AdamOptions(args.lr).betas({0.5, 0.999});
  torch::optim::Adam opt_g(G->parameters(), adam);
  torch::optim::Adam opt_d(D->parameters(), adam);
  auto train =
      fashion::Dataset(args.data_dir, true, args.train_limit).map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(std::move(train),
                                                                                        args.batch_size);
  auto bce = [](const torch::Tensor& logits, double label) {
    return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, label));
  };

  std::uint64_t step = 0;  // global batch index, over all epochs
  torch::Tensor d_loss, g_loss;
  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    auto d_sum = torch::zeros({}), g_sum = torch::zeros({});
    std::int64_t batches = 0;
    for (auto& batch : *loader) {
      const auto real = batch.data.flatten(1);
      const auto rows = real.size(0);
      // Noise of global batch `step` from a generator seeded by (--seed, step): every process draws the noise
      // of the whole global batch and takes its own rows, so N ranks with batch B draw what one process with
      // batch N*B draws (see gan::noise).
      auto [z, z2] = gan::noise(args.seed, step++, args.batch_size, rows);

      opt_d.zero_grad();
      d_loss = bce(D(real), 1) + bce(D(G(z).detach()), 0);
      d_loss.backward();
      opt_d.step();

      opt_g.zero_grad();
      g_loss = bce(D(G(z2)), 1);  // D gets gradients too; opt_d.zero_grad() clears them before D's next step
      g_loss.backward();
      opt_g.step();

      d_sum += d_loss.detach();
      g_sum += g_loss.detach();
      ++batches;
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    const auto d_mean = d_sum / batches, g_mean = g_sum / batches;
    std::cout << "epoch " << epoch << ": d_loss " << gan::g6(d_mean) << " g_loss " << gan::g6(g_mean) << " ("
              << gan::g6(took.count()) << " s)" << std::endl;
  }

  const auto d_last = d_loss.detach(), g_last = g_loss.detach();
  std::cout << "final d_loss " << gan::g6(d_last) << " g_loss " << gan::g6(g_last) << std::endl;
  const auto g_weights = G->named_parameters();
  const auto d_weights = D->named_parameters();
  std::cout << "weight checksum G=" << gan::g6(gan::abs_sum(g_weights))
            << " D=" << gan::g6(gan::abs_sum(d_weights)) << std::endl;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
