// CUDA graphs for the decode step (engine/src/model/cuda_graph.rs): libtorch's
// at::cuda::CUDAGraph, which tch does not expose. The Rust side runs ordinary tch
// operations between yatt_graph_capture_begin and yatt_graph_capture_end; they are
// recorded, not run, and yatt_graph_replay then runs them all with one launch.
//
// Capture happens on a side stream (a capture on the legacy default stream is illegal),
// in thread-local mode so that other threads of the process (a trainer beside the
// rollout) may keep using CUDA meanwhile. Every graph of one generator shares one
// memory pool: they are replayed one at a time and only their outputs, which stay
// allocated, outlive a replay.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <optional>

namespace {

// As yatt::set_err (onednn_linear.cpp), which this separate library cannot rely on.
void set_err(char* err, size_t len, const char* msg) {
  if (err && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = 0;
  }
}

struct Graph {
  at::cuda::CUDAGraph graph;
  std::optional<c10::cuda::CUDAStream> side;
  std::optional<c10::cuda::CUDAStreamGuard> on_side_stream;
  c10::DeviceIndex device = 0;
};

// Waits for the side stream and makes the previous stream current again. Only streams
// this thread uses are waited for, never the whole device: another thread (a second
// rollout in the process) may be capturing, and a device-wide wait would invalidate its
// capture.
void leave(Graph* g) {
  if (g->side) g->side->synchronize();
  g->on_side_stream.reset();
}

}  // namespace

extern "C" {

// A new, empty graph for CUDA device `device`.
void* yatt_graph_new(int64_t device, char* err, size_t errlen) {
  try {
    auto* g = new Graph();
    g->device = static_cast<c10::DeviceIndex>(device);
    return g;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return nullptr;
  }
}

// Makes a side stream of the graph's device current (after the current stream's work,
// e.g. the copies of the step's inputs, is done), so that warm-up runs and the capture
// itself use the stream the capture will record.
int yatt_graph_enter_side_stream(void* gp, char* err, size_t errlen) {
  try {
    auto* g = static_cast<Graph*>(gp);
    c10::cuda::getCurrentCUDAStream(g->device).synchronize();
    g->side.emplace(c10::cuda::getStreamFromPool(false, g->device));
    g->on_side_stream.emplace(*g->side);
    return 0;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return 1;
  }
}

// Starts recording on the (current) side stream. `pool_a`/`pool_b`: the memory pool to
// share (0, 0: a new private pool; read it back with yatt_graph_pool).
int yatt_graph_capture_begin(void* gp, uint64_t pool_a, uint64_t pool_b, char* err,
                             size_t errlen) {
  try {
    auto* g = static_cast<Graph*>(gp);
    g->graph.capture_begin({pool_a, pool_b}, cudaStreamCaptureModeThreadLocal);
    return 0;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return 1;
  }
}

// Stops recording, instantiates the graph and restores the previous current stream
// (after waiting for the side stream, so the warm-up's results are visible).
int yatt_graph_capture_end(void* gp, char* err, size_t errlen) {
  auto* g = static_cast<Graph*>(gp);
  try {
    g->graph.capture_end();
    leave(g);
    return 0;
  } catch (const std::exception& e) {
    try {
      leave(g);
    } catch (...) {
      g->on_side_stream.reset();
    }
    set_err(err, errlen, e.what());
    return 1;
  }
}

// Leaves the side stream without capturing (after a failed warm-up or capture).
void yatt_graph_leave_side_stream(void* gp) {
  auto* g = static_cast<Graph*>(gp);
  try {
    leave(g);
  } catch (...) {
    g->on_side_stream.reset();
  }
}

// The graph's memory pool id, to share with later captures.
void yatt_graph_pool(void* gp, uint64_t* a, uint64_t* b) {
  auto id = static_cast<Graph*>(gp)->graph.pool();
  *a = id.first;
  *b = id.second;
}

// Runs the recorded work on the current stream of the graph's device.
int yatt_graph_replay(void* gp, char* err, size_t errlen) {
  try {
    auto* g = static_cast<Graph*>(gp);
    c10::cuda::CUDAGuard guard(g->device);
    g->graph.replay();
    return 0;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return 1;
  }
}

void yatt_graph_free(void* gp) {
  auto* g = static_cast<Graph*>(gp);
  g->on_side_stream.reset();
  delete g;
}
}
