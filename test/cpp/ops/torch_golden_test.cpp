// Bit-for-bit agreement with numbers produced by torch's own CPU kernels
// (torch_golden_data.h, written by gen_torch_golden.py), on every supported path, three steps,
// from fp32 gradients. This pins the rounding decisions of Note [Parity with torch.optim]
// (FusedOptim.cpp): an FMA added or dropped anywhere changes some of these bits.
#include <string>
#include <vector>

#include "ops_test_util.h"
#include "torch_golden_data.h"

namespace superchip::ops::test {
namespace {

using golden::kN;

std::vector<float> floats(const uint32_t* bits) {
  std::vector<float> out(kN);
  for (int i = 0; i < kN; ++i) out[static_cast<size_t>(i)] = bits_float(bits[i]);
  return out;
}

::testing::AssertionResult same_bits(const char* what, const std::vector<float>& got,
                                     const uint32_t* want) {
  for (int i = 0; i < kN; ++i) {
    if (float_bits(got[static_cast<size_t>(i)]) != want[i]) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << got[static_cast<size_t>(i)] << " (0x" << std::hex
             << float_bits(got[static_cast<size_t>(i)]) << "), torch gives "
             << bits_float(want[i]) << " (0x" << want[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

struct AdamGolden {
  const char* name;
  AdamHyper h;
  const uint32_t* p0;
  const uint32_t* g[3];
  const uint32_t* p;
  const uint32_t* m;
  const uint32_t* v;
  const uint32_t* vmax;
};

std::vector<AdamGolden> adam_goldens() {
  using namespace golden;
  AdamHyper w;
  w.lr = 1e-2;
  w.weight_decay = 0.1;
  w.decoupled_weight_decay = true;
  w.amsgrad = true;
  AdamHyper l2;
  l2.lr = 0.1;
  l2.beta1 = 0.3;
  l2.beta2 = 0.95;
  l2.eps = 1e-6;
  l2.weight_decay = 0.05;
  l2.maximize = true;
  return {
      {"adamw_amsgrad", w, adamw_amsgrad_p0,
       {adamw_amsgrad_g0, adamw_amsgrad_g1, adamw_amsgrad_g2}, adamw_amsgrad_p, adamw_amsgrad_m,
       adamw_amsgrad_v, adamw_amsgrad_vmax},
      {"adam_l2_maximize_b1_03", l2, adam_l2_maximize_b1_03_p0,
       {adam_l2_maximize_b1_03_g0, adam_l2_maximize_b1_03_g1, adam_l2_maximize_b1_03_g2},
       adam_l2_maximize_b1_03_p, adam_l2_maximize_b1_03_m, adam_l2_maximize_b1_03_v,
       adam_l2_maximize_b1_03_vmax},
  };
}

class TorchGoldenTest : public ::testing::TestWithParam<SimdPath> {};

TEST_P(TorchGoldenTest, AdamMatchesTorchKernelsBitForBit) {
  const SimdPath path = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  for (const AdamGolden& c : adam_goldens()) {
    SCOPED_TRACE(c.name);
    std::vector<float> p = floats(c.p0), m(kN, 0.0f), v(kN, 0.0f), vmax(kN, 0.0f);
    for (int step = 1; step <= golden::kSteps; ++step) {
      const std::vector<float> g = floats(c.g[step - 1]);
      AdamHyper h = c.h;
      h.step = step;
      AdamArrays a;
      a.param = p.data();
      a.exp_avg = m.data();
      a.exp_avg_sq = v.data();
      a.max_exp_avg_sq = h.amsgrad ? vmax.data() : nullptr;
      a.grad = g.data();
      a.n = kN;
      adam_step(h, a, path);
    }
    EXPECT_TRUE(same_bits("param", p, c.p));
    EXPECT_TRUE(same_bits("exp_avg", m, c.m));
    EXPECT_TRUE(same_bits("exp_avg_sq", v, c.v));
    if (c.h.amsgrad) {
      EXPECT_TRUE(same_bits("max_exp_avg_sq", vmax, c.vmax));
    }
  }
}

TEST_P(TorchGoldenTest, SgdMatchesTorchOptimBitForBit) {
  const SimdPath path = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  using namespace golden;
  struct Case {
    const char* name;
    SgdHyper h;
    const uint32_t* p0;
    const uint32_t* g[3];
    const uint32_t* p;
    const uint32_t* buf;
  };
  SgdHyper nesterov;
  nesterov.lr = 0.05;
  nesterov.momentum = 0.9;
  nesterov.nesterov = true;
  nesterov.weight_decay = 0.01;
  nesterov.maximize = true;
  SgdHyper damp;
  damp.lr = 0.1;
  damp.momentum = 0.5;
  damp.dampening = 0.3;
  damp.weight_decay = 0.2;
  const Case cases[] = {
      {"nesterov", nesterov, sgd_nesterov_p0, {sgd_nesterov_g0, sgd_nesterov_g1, sgd_nesterov_g2},
       sgd_nesterov_p, sgd_nesterov_buf},
      {"dampening", damp, sgd_dampening_p0, {sgd_dampening_g0, sgd_dampening_g1, sgd_dampening_g2},
       sgd_dampening_p, sgd_dampening_buf},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> p = floats(c.p0), buf(kN, 0.0f);
    for (int step = 0; step < golden::kSteps; ++step) {
      const std::vector<float> g = floats(c.g[step]);
      SgdHyper h = c.h;
      h.first_step = step == 0;
      SgdArrays a;
      a.param = p.data();
      a.momentum_buffer = buf.data();
      a.grad = g.data();
      a.n = kN;
      sgd_step(h, a, path);
    }
    EXPECT_TRUE(same_bits("param", p, c.p));
    EXPECT_TRUE(same_bits("momentum_buffer", buf, c.buf));
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, TorchGoldenTest, ::testing::ValuesIn(all_paths()),
                         [](const ::testing::TestParamInfo<SimdPath>& info) {
                           return std::string(simd_path_name(info.param));
                         });

}  // namespace
}  // namespace superchip::ops::test
