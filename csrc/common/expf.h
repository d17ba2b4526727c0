// Cephes' expf polynomial on the reduced argument: the core of the CPU kernels' float exp
// (ffn.cpp's full-range exp_f32, attention_softmax.cpp's exp of a score minus its row's max),
// branch-free so that loops over it vectorize (std::exp does not).
#pragma once

namespace fastformer {

// exp(x) = p * 2^n: returns p = exp(x - n ln 2) by the degree-6 polynomial of Cephes' expf
// (relative error ~1e-7) and sets n = round(x / ln 2), for |x| < 2^22.
#if defined(__GNUC__) || defined(__clang__)
inline __attribute__((always_inline))
#else
inline
#endif
float expf_reduced(float x, float& n) {
  n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // 1.5 * 2^23: rounds to integers
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

}  // namespace fastformer
