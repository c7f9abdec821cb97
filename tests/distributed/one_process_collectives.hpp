#pragma once
// Every collective of a one-process communicator over real c10d groups (accel::open_communicator) must be the
// identity: checked on `device` (Gloo on the CPU, NCCL on a GPU) by tests/distributed/communicator_test.cpp
// and tests/gpu/gpu_test.cpp.

#include <accel/distributed/communicator.hpp>

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace accel::test {

inline void check_one_process_collectives(Communicator& comm, const torch::Device& device) {
  REQUIRE(comm.world_size() == 1);
  const auto expected = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  auto t = expected.clone();
  comm.all_reduce(t, ReduceOp::Sum);
  CHECK(torch::equal(t, expected));
  comm.broadcast(t, 0);
  CHECK(torch::equal(t, expected));
  CHECK(torch::equal(comm.all_gather(t), expected));
  CHECK(torch::equal(comm.reduce_scatter(t, ReduceOp::Sum), expected));
  auto out = torch::zeros_like(t);
  comm.all_gather_async(out, t)->wait();
  CHECK(torch::equal(out, expected));
  out.zero_();
  comm.reduce_scatter_async(out, t)->wait();
  CHECK(torch::equal(out, expected));
  auto r = expected.clone();
  comm.reduce_async(r, 0)->wait();
  CHECK(torch::equal(r, expected));
  std::vector<torch::Tensor> list{expected.clone()};
  comm.all_reduce_async(list)->wait();
  CHECK(torch::equal(list[0], expected));
  // Two tensors, each reduced on its own (a list handed to the process group as is would be taken for one
  // buffer on two devices: Gloo summed them into each other).
  std::vector<torch::Tensor> two{expected.clone(), expected.narrow(0, 0, 2) * 10};
  comm.all_reduce_async(two)->wait();
  CHECK(torch::equal(two[0], expected));
  CHECK(torch::equal(two[1], expected.narrow(0, 0, 2) * 10));
  comm.barrier();
  CHECK(comm.exchange("one") == std::vector<std::string>{"one"});
}

}  // namespace accel::test
