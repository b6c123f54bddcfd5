// ATen's CPU Bernoulli draws, made fast and kept bit for bit (DESIGN.md section 7, "Dropout on the
// CPU"); no LibTorch (model/fast_dropout.cpp reads and writes the generator's state around them).
//
// ATen's default CPU generator is a Mersenne twister (at::mt19937). Where ATen's bernoulli_(p) does
// not use MKL (every CPU not made by Intel, and LibTorch builds without MKL), each element is one
// bernoulli_distribution<double>(p) draw: random64() (two 32-bit outputs, the first the high word),
// its low 53 bits k as k / 2^53, kept when below p. That is one element at a time through the
// generator's lock and a TensorIterator: about 8 ns per element on this project's AMD EPYC, a fifth
// of a GPT step with dropout 0.2 (bench/results_dropout.md). Here the twister's state is
// regenerated 16 words at a time, tempered in vectors, and k < p 2^53 is an integer compare: the
// same numbers, in the same order, leaving the generator where ATen would leave it.
#pragma once
#include <cstdint>

namespace mfsdp {

// The twister's words and position as at::mt19937_data_pod holds them: `left` - 1 tempered outputs
// remain at state[next...] before the state is regenerated.
struct Mt19937State {
  uint32_t state[624];
  int32_t left;
  uint32_t next;
};

// keep[i] = 1 when the i-th of n draws of bernoulli_distribution<double>(p) succeeds, else 0;
// advances `s` by 2n outputs.
void mt19937_bernoulli(Mt19937State& s, double p, uint8_t* keep, int64_t n);

// Dropout's element pass: y[i] = keep[i] ? x[i] * scale : x[i] * 0 (what x * noise gives: a signed
// zero, NaN for an infinite or NaN x), on floats and on bfloat16 (computed in float, rounded to
// nearest even). In place is allowed (y == x).
void dropout_apply(const float* x, const uint8_t* keep, float scale, float* y, int64_t n);
void dropout_apply_bf16(const uint16_t* x, const uint8_t* keep, float scale, uint16_t* y, int64_t n);

}  // namespace mfsdp
