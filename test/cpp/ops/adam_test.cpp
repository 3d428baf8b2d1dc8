// adam_step on every SIMD path against adam_step_ref (tolerance table) and against the scalar
// path (bit for bit), at every tail size, aligned and misaligned, every grad x lowp dtype,
// Adam/AdamW/amsgrad/maximize, first and later steps; threads; non-finite values.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>

#include "ops/cpu/ThreadPool.h"
#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

struct AdamVariant {
  std::string name;
  AdamHyper h;
};

std::vector<AdamVariant> adam_variants() {
  std::vector<AdamVariant> v;
  AdamHyper h;
  v.push_back({"adam", h});
  h = AdamHyper{};
  h.lr = 1e-2;
  h.weight_decay = 0.05;
  v.push_back({"adam_l2", h});
  h = AdamHyper{};
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.01;
  v.push_back({"adamw", h});
  h = AdamHyper{};
  h.lr = 3e-3;
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.1;
  h.amsgrad = true;
  v.push_back({"adamw_amsgrad", h});
  h = AdamHyper{};
  h.weight_decay = 0.02;
  h.maximize = true;
  h.amsgrad = true;
  v.push_back({"adam_l2_maximize_amsgrad", h});
  // 1 - beta1 >= 0.5 takes torch's other lerp form.
  h = AdamHyper{};
  h.lr = 0.1;
  h.beta1 = 0.3;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.1;
  h.maximize = true;
  v.push_back({"adamw_maximize_beta1_0.3", h});
  return v;
}

struct AdamState {
  Buffer p, m, v, vmax, g, lp;
  DTypeCombo c;

  AdamState(int64_t n, const DTypeCombo& combo, int64_t offset)
      : p(n, 4, offset), m(n, 4, offset), v(n, 4, offset), vmax(n, 4, offset),
        g(n, dtype_size(combo.grad), offset), lp(n, 2, offset), c(combo) {}

  AdamArrays arrays(bool amsgrad) {
    AdamArrays a;
    a.param = p.f32();
    a.exp_avg = m.f32();
    a.exp_avg_sq = v.f32();
    a.max_exp_avg_sq = amsgrad ? vmax.f32() : nullptr;
    a.grad = g.data();
    a.grad_dtype = c.grad;
    a.param_lowp = c.has_lowp ? lp.data() : nullptr;
    a.lowp_dtype = c.lowp;
    a.n = p.size();
    return a;
  }
  void assign(const AdamState& o) {
    p.assign(o.p);
    m.assign(o.m);
    v.assign(o.v);
    vmax.assign(o.vmax);
    g.assign(o.g);
    lp.assign(o.lp);
  }
  bool guards_intact() const {
    return p.guards_intact() && m.guards_intact() && v.guards_intact() && vmax.guards_intact() &&
           g.guards_intact() && lp.guards_intact();
  }
  bool same_bytes(const AdamState& o) const {
    return p.same_bytes(o.p) && m.same_bytes(o.m) && v.same_bytes(o.v) &&
           vmax.same_bytes(o.vmax) && lp.same_bytes(o.lp);
  }
};

using AdamParam = std::tuple<SimdPath, DTypeCombo>;

class AdamPathTest : public ::testing::TestWithParam<AdamParam> {};

TEST_P(AdamPathTest, MatchesReferenceAndScalarPath) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  for (const AdamVariant& var : adam_variants()) {
    for (int64_t n : tail_sizes(simd_path_width(path))) {
      const bool large = n > 1000;
      for (int64_t offset : {0, 1}) {
        for (bool zero_state : {true, false}) {
          if (large && (offset == 0 || zero_state)) continue;  // keep the run short
          SCOPED_TRACE(var.name + " n=" + std::to_string(n) + " offset=" +
                       std::to_string(offset) + (zero_state ? " zero state" : " random state"));
          std::mt19937 rng(static_cast<uint32_t>(n * 4 + offset * 2 + zero_state));
          AdamState s(n, combo, offset), ref(n, combo, 0), scalar(n, combo, 0);
          if (!zero_state) {
            fill_uniform(s.p, rng, -2.0f, 2.0f);
            fill_uniform(s.m, rng, -0.5f, 0.5f);
            fill_uniform(s.v, rng, 0.01f, 1.0f);
            fill_uniform(s.vmax, rng, 0.01f, 1.2f);
          } else {
            fill_uniform(s.p, rng, -2.0f, 2.0f);
          }
          const std::vector<int64_t> steps = large ? std::vector<int64_t>{1, 1000}
                                                   : std::vector<int64_t>{1, 2, 10, 1000};
          for (int64_t step : steps) {
            SCOPED_TRACE("step " + std::to_string(step));
            AdamHyper h = var.h;
            h.step = step;
            fill_grad(s.g, combo.grad, rng, -3.0f, 3.0f);
            ref.assign(s);
            scalar.assign(s);
            adam_step(h, s.arrays(h.amsgrad), path);
            adam_step_ref(h, ref.arrays(h.amsgrad));
            ASSERT_TRUE(s.guards_intact()) << "wrote outside the arrays";
            EXPECT_TRUE(all_close("param", s.p.f32(), ref.p.f32(), n));
            EXPECT_TRUE(all_close("exp_avg", s.m.f32(), ref.m.f32(), n));
            EXPECT_TRUE(all_close("exp_avg_sq", s.v.f32(), ref.v.f32(), n));
            if (h.amsgrad) {
              EXPECT_TRUE(all_close("max_exp_avg_sq", s.vmax.f32(), ref.vmax.f32(), n));
            }
            if (combo.has_lowp) {
              EXPECT_TRUE(all_close_lowp("param_lowp", combo.lowp, s.lp.u16(), ref.lp.u16(), n));
              EXPECT_TRUE(lowp_matches_param(combo.lowp, s.lp.u16(), s.p.f32(), n));
            }
            if (path != SimdPath::kScalar) {
              adam_step(h, scalar.arrays(h.amsgrad), SimdPath::kScalar);
              EXPECT_TRUE(s.same_bytes(scalar)) << simd_path_name(path) << " differs from scalar";
            }
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// Threads split at 64-byte boundaries; the result must not depend on the split.
TEST_P(AdamPathTest, ThreadPoolGivesSameBitsAsOneThread) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  const int64_t n = (int64_t{1} << 18) + 13;
  ThreadPool pool(3);
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    std::mt19937 rng(7);
    AdamState a(n, combo, offset), b(n, combo, 0);
    fill_uniform(a.p, rng, -2.0f, 2.0f);
    fill_uniform(a.m, rng, -0.5f, 0.5f);
    fill_uniform(a.v, rng, 0.01f, 1.0f);
    fill_uniform(a.vmax, rng, 0.01f, 1.2f);
    fill_grad(a.g, combo.grad, rng, -3.0f, 3.0f);
    b.assign(a);
    AdamHyper h = adam_variants()[3].h;  // AdamW + amsgrad
    h.step = 5;
    adam_step(h, a.arrays(true), path, &pool);
    adam_step(h, b.arrays(true), path, nullptr);
    EXPECT_TRUE(a.guards_intact());
    EXPECT_TRUE(a.same_bytes(b));
  }
}

// NaN and inf flow through like the scalar path (bit for bit where finite); a NaN parameter
// becomes the canonical NaN of its low-precision copy.
TEST_P(AdamPathTest, NonFiniteValuesMatchScalarPath) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  const int64_t n = 67;
  std::mt19937 rng(3);
  AdamState s(n, combo, 1), scalar(n, combo, 0);
  fill_uniform(s.p, rng, -2.0f, 2.0f);
  fill_uniform(s.m, rng, -0.5f, 0.5f);
  fill_uniform(s.v, rng, 0.01f, 1.0f);
  fill_uniform(s.vmax, rng, 0.01f, 1.2f);
  fill_grad(s.g, combo.grad, rng, -3.0f, 3.0f);
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  s.p.f32()[3] = qnan;
  s.p.f32()[20] = -qnan;
  s.m.f32()[40] = inf;
  s.vmax.f32()[50] = qnan;
  s.p.f32()[60] = 3e38f;  // overflows bf16/fp16 when rounded
  auto set_grad = [&](int64_t i, float x) {
    if (combo.grad == DType::kF32) s.g.f32()[i] = x;
    else if (combo.grad == DType::kBF16) s.g.u16()[i] = float_to_bf16(x);
    else s.g.u16()[i] = float_to_fp16(x);
  };
  set_grad(10, qnan);
  set_grad(30, -inf);
  scalar.assign(s);
  AdamHyper h = adam_variants()[4].h;  // L2 + maximize + amsgrad
  h.step = 3;
  adam_step(h, s.arrays(true), path);
  adam_step(h, scalar.arrays(true), SimdPath::kScalar);
  for (int64_t i = 0; i < n; ++i) {
    const float got = s.p.f32()[i], want = scalar.p.f32()[i];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "param[" << i << "]";
    } else {
      EXPECT_EQ(float_bits(got), float_bits(want)) << "param[" << i << "]";
    }
    EXPECT_EQ(std::isnan(s.m.f32()[i]), std::isnan(scalar.m.f32()[i])) << "exp_avg[" << i << "]";
    EXPECT_EQ(std::isnan(s.vmax.f32()[i]), std::isnan(scalar.vmax.f32()[i])) << "max[" << i << "]";
  }
  EXPECT_TRUE(std::isnan(s.p.f32()[3]) && std::isnan(s.p.f32()[10]) && std::isnan(s.p.f32()[50]));
  if (combo.has_lowp) {
    EXPECT_TRUE(lowp_matches_param(combo.lowp, s.lp.u16(), s.p.f32(), n));
    const uint16_t canon = combo.lowp == DType::kBF16 ? 0x7FC0 : 0x7E00;
    EXPECT_EQ(s.lp.u16()[3] & 0x7FFF, canon);
  }
}

std::vector<AdamParam> adam_params() {
  std::vector<AdamParam> out;
  for (SimdPath p : all_paths()) {
    for (const DTypeCombo& c : all_dtype_combos()) out.emplace_back(p, c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Paths, AdamPathTest, ::testing::ValuesIn(adam_params()),
                         [](const ::testing::TestParamInfo<AdamParam>& info) {
                           return combo_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

// ---- argument checks ----

TEST(AdamArgs, EmptyIsANoOpEvenWithoutArrays) {
  AdamHyper h;
  AdamArrays a;  // all null, n == 0
  for (SimdPath p : all_paths()) {
    if (simd_path_supported(p)) {
      EXPECT_NO_THROW(adam_step(h, a, p));
    }
  }
  EXPECT_NO_THROW(adam_step_ref(h, a));
}

TEST(AdamArgs, InvalidArgumentsThrowBeforeWriting) {
  float p[4] = {1, 2, 3, 4}, m[4] = {}, v[4] = {}, g[4] = {1, 1, 1, 1};
  AdamArrays a;
  a.param = p;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  a.grad = g;
  a.n = 4;
  AdamHyper h;
  const SimdPath path = best_simd_path();

  AdamArrays bad = a;
  bad.n = -1;
  EXPECT_THROW(adam_step(h, bad, path), std::invalid_argument);
  bad = a;
  bad.exp_avg = nullptr;
  EXPECT_THROW(adam_step(h, bad, path), std::invalid_argument);
  bad = a;
  bad.grad = nullptr;
  EXPECT_THROW(adam_step_ref(h, bad), std::invalid_argument);
  bad = a;
  bad.param_lowp = p;
  bad.lowp_dtype = DType::kF32;
  EXPECT_THROW(adam_step(h, bad, path), std::invalid_argument);
  AdamHyper hb = h;
  hb.amsgrad = true;  // without max_exp_avg_sq
  EXPECT_THROW(adam_step(hb, a, path), std::invalid_argument);
  hb = h;
  hb.step = 0;
  EXPECT_THROW(adam_step(hb, a, path), std::invalid_argument);
  for (SimdPath unsupported : all_paths()) {
    if (!simd_path_supported(unsupported)) {
      EXPECT_THROW(adam_step(h, a, unsupported), std::invalid_argument);
    }
  }
  EXPECT_EQ(p[0], 1.0f);
  EXPECT_EQ(m[0], 0.0f);
}

// The first step from zero state moves every parameter by lr against the gradient's sign
// (m/sqrt(v) is exactly sign(g) after bias correction, up to eps).
TEST(AdamSemantics, FirstStepMovesByLr) {
  const int64_t n = 37;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = (i % 2 ? 1.0f : -1.0f) * (0.5f + static_cast<float>(i));
  AdamArrays a;
  a.param = p.data();
  a.exp_avg = m.data();
  a.exp_avg_sq = v.data();
  a.grad = g.data();
  a.n = n;
  AdamHyper h;
  h.lr = 0.01;
  adam_step(h, a, best_simd_path());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], i % 2 ? 0.99f : 1.01f, 1e-6) << i;
  }
}

}  // namespace
}  // namespace superchip::ops::test
