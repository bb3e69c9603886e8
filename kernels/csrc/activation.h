// The FFN activations, as the kernels receive them: the codes of models/activations.py's table
// (Python passes `activations.code(name)`; tests/test_activations.py checks every code here
// names the same activation there). One enum, one "is it gated" rule, one scalar formula for
// the neuron-bundle kernel; fused_ops.cpp's `ffn_activation` applies the same switch with the
// ATen ops PyTorch's reference uses.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

enum class Activation : int64_t {
  RELU = 0,      // h = relu(up)
  RELU2 = 1,     // h = relu(up)^2
  RELU_GLU = 2,  // h = relu(gate) * up
  DRELU = 3,     // h = relu(gate) * relu(up)
  SILU_GLU = 4,  // h = silu(gate) * up
  GELU_GLU = 5,  // h = gelu_tanh(gate) * up
};
constexpr int64_t kActivationCount = 6;

// A code from Python as the enum; a clear error for one outside the table.
inline Activation activation_of(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kActivationCount, "unknown activation code ", code,
              " (models/activations.py lists 0..", kActivationCount - 1, ")");
  return static_cast<Activation>(code);
}

// Gated activations read gate rows as well as up rows; plain ones only up rows.
inline bool is_gated(Activation act) {
  return act != Activation::RELU && act != Activation::RELU2;
}

// The table's names, for the test that both sides agree.
inline const char* activation_name(Activation act) {
  switch (act) {
    case Activation::RELU: return "relu";
    case Activation::RELU2: return "relu2";
    case Activation::RELU_GLU: return "relu_glu";
    case Activation::DRELU: return "drelu";
    case Activation::SILU_GLU: return "silu_glu";
    case Activation::GELU_GLU: return "gelu_glu";
  }
  return "?";
}

inline float relu_scalar(float v) { return v > 0.f ? v : 0.f; }

// One neuron's h from its gate and up dots (g unused for plain activations), in float32.
inline float activate(Activation act, float g, float u) {
  switch (act) {
    case Activation::RELU: return relu_scalar(u);
    case Activation::RELU2: { float r = relu_scalar(u); return r * r; }
    case Activation::RELU_GLU: return relu_scalar(g) * u;
    case Activation::DRELU: return relu_scalar(g) * relu_scalar(u);
    case Activation::SILU_GLU: return g / (1.f + std::exp(-g)) * u;
    case Activation::GELU_GLU: {  // tanh approximation (as PyTorch's approximate="tanh")
      const float k = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * g * (1.f + std::tanh(k * (g + 0.044715f * g * g * g))) * u;
    }
  }
  return 0.f;
}
