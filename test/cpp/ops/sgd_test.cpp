// sgd_step on every SIMD path against sgd_step_ref (tolerance table) and the scalar path (bit
// for bit): plain, momentum (first step = grad clone, undampened), dampening, nesterov, weight
// decay, maximize, at every tail size, aligned and misaligned, every grad x lowp dtype; plus
// the grad widening and lowp narrowing of every path checked over whole bit-pattern ranges.
#include <limits>
#include <string>
#include <tuple>

#include "ops/cpu/ThreadPool.h"
#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

struct SgdVariant {
  std::string name;
  SgdHyper h;
};

std::vector<SgdVariant> sgd_variants() {
  std::vector<SgdVariant> v;
  SgdHyper h;
  h.lr = 0.01;
  v.push_back({"plain", h});
  h.weight_decay = 0.01;
  h.maximize = true;
  v.push_back({"wd_maximize", h});
  h = SgdHyper{};
  h.lr = 0.05;
  h.momentum = 0.9;
  v.push_back({"momentum", h});
  h.dampening = 0.1;
  h.weight_decay = 1e-4;
  v.push_back({"momentum_dampening_wd", h});
  h = SgdHyper{};
  h.lr = 0.1;
  h.momentum = 0.8;
  h.nesterov = true;
  h.weight_decay = 0.05;
  h.maximize = true;
  v.push_back({"nesterov_wd_maximize", h});
  return v;
}

struct SgdState {
  Buffer p, buf, g, lp;
  DTypeCombo c;
  SgdState(int64_t n, const DTypeCombo& combo, int64_t offset)
      : p(n, 4, offset), buf(n, 4, offset), g(n, dtype_size(combo.grad), offset), lp(n, 2, offset),
        c(combo) {}
  SgdArrays arrays() {
    SgdArrays a;
    a.param = p.f32();
    a.momentum_buffer = buf.f32();
    a.grad = g.data();
    a.grad_dtype = c.grad;
    a.param_lowp = c.has_lowp ? lp.data() : nullptr;
    a.lowp_dtype = c.lowp;
    a.n = p.size();
    return a;
  }
  void assign(const SgdState& o) {
    p.assign(o.p);
    buf.assign(o.buf);
    g.assign(o.g);
    lp.assign(o.lp);
  }
  bool guards_intact() const {
    return p.guards_intact() && buf.guards_intact() && g.guards_intact() && lp.guards_intact();
  }
  bool same_bytes(const SgdState& o) const {
    return p.same_bytes(o.p) && buf.same_bytes(o.buf) && lp.same_bytes(o.lp);
  }
};

using SgdParam = std::tuple<SimdPath, DTypeCombo>;
class SgdPathTest : public ::testing::TestWithParam<SgdParam> {};

TEST_P(SgdPathTest, MatchesReferenceAndScalarPath) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  for (const SgdVariant& var : sgd_variants()) {
    for (int64_t n : tail_sizes(simd_path_width(path))) {
      for (int64_t offset : {0, 1}) {
        if (n > 1000 && offset == 0) continue;
        SCOPED_TRACE(var.name + " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        std::mt19937 rng(static_cast<uint32_t>(n * 2 + offset));
        SgdState s(n, combo, offset), ref(n, combo, 0), scalar(n, combo, 0);
        fill_uniform(s.p, rng, -2.0f, 2.0f);
        fill_uniform(s.buf, rng, -9.0f, 9.0f);  // garbage: the first step must overwrite it
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE("step " + std::to_string(step + 1));
          SgdHyper h = var.h;
          h.first_step = step == 0;
          fill_grad(s.g, combo.grad, rng, -3.0f, 3.0f);
          ref.assign(s);
          scalar.assign(s);
          sgd_step(h, s.arrays(), path);
          sgd_step_ref(h, ref.arrays());
          ASSERT_TRUE(s.guards_intact()) << "wrote outside the arrays";
          EXPECT_TRUE(all_close("param", s.p.f32(), ref.p.f32(), n));
          if (h.momentum != 0.0) {
            EXPECT_TRUE(all_close("momentum_buffer", s.buf.f32(), ref.buf.f32(), n));
          }
          if (combo.has_lowp) {
            EXPECT_TRUE(all_close_lowp("param_lowp", combo.lowp, s.lp.u16(), ref.lp.u16(), n));
            EXPECT_TRUE(lowp_matches_param(combo.lowp, s.lp.u16(), s.p.f32(), n));
          }
          if (path != SimdPath::kScalar) {
            sgd_step(h, scalar.arrays(), SimdPath::kScalar);
            EXPECT_TRUE(s.same_bytes(scalar)) << simd_path_name(path) << " differs from scalar";
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(SgdPathTest, ThreadPoolGivesSameBitsAsOneThread) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  const int64_t n = (int64_t{1} << 18) + 5;
  ThreadPool pool(2);
  std::mt19937 rng(11);
  SgdState a(n, combo, 1), b(n, combo, 0);
  fill_uniform(a.p, rng, -2.0f, 2.0f);
  fill_uniform(a.buf, rng, -1.0f, 1.0f);
  fill_grad(a.g, combo.grad, rng, -3.0f, 3.0f);
  b.assign(a);
  SgdHyper h = sgd_variants()[4].h;
  h.first_step = false;
  sgd_step(h, a.arrays(), path, &pool);
  sgd_step(h, b.arrays(), path, nullptr);
  EXPECT_TRUE(a.guards_intact());
  EXPECT_TRUE(a.same_bytes(b));
}

std::vector<SgdParam> sgd_params() {
  std::vector<SgdParam> out;
  for (SimdPath p : all_paths()) {
    for (const DTypeCombo& c : all_dtype_combos()) out.emplace_back(p, c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Paths, SgdPathTest, ::testing::ValuesIn(sgd_params()),
                         [](const ::testing::TestParamInfo<SgdParam>& info) {
                           return combo_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

// ---- conversions of every path, through SGD ----
// lr = -1 and param = 0 make param = grad exactly (0 + g*1): every bf16/fp16 pattern widens.
// lr = 0 leaves param as is (p + g*-0) and writes its rounded copy: the narrowing.

class ConversionTest : public ::testing::TestWithParam<SimdPath> {};

TEST_P(ConversionTest, WidensEveryGradPattern) {
  const SimdPath path = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  const int64_t n = 65536;
  for (DType d : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(d));
    Buffer p(n, 4, 1), g(n, 2, 1);
    for (int64_t i = 0; i < n; ++i) g.u16()[i] = static_cast<uint16_t>(i);
    SgdArrays a;
    a.param = p.f32();
    a.grad = g.data();
    a.grad_dtype = d;
    a.n = n;
    SgdHyper h;
    h.lr = -1.0;
    sgd_step(h, a, path);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(lowp_value(d, static_cast<uint16_t>(i)));
      const float want = x + 0.0f;  // -0 * 1 + 0 is +0
      const float got = p.f32()[i];
      if (std::isnan(want) ? !std::isnan(got) : float_bits(got) != float_bits(want)) ++bad;
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST_P(ConversionTest, NarrowsLikeTheScalarConversion) {
  const SimdPath path = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  // Special values, every fp16 value and the ties/neighbours between consecutive fp16 and
  // bf16 values, then random bit patterns.
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 3.4e38f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::quiet_NaN(),
                           bits_float(0x7F800001u), bits_float(0xFFFFFFFFu),
                           bits_float(0x00000001u), bits_float(0x807FFFFFu), 0x1p-24f, 0x1p-25f,
                           0x1.8p-25f, 0x1p-14f, 0x1.ffcp-15f};
  for (uint32_t h = 0; h < 0x7C00u; ++h) {
    const uint32_t b = float_bits(fp16_to_float(static_cast<uint16_t>(h)));
    const uint32_t next = float_bits(fp16_to_float(static_cast<uint16_t>(h + 1)));
    const uint32_t mid = b + (next - b) / 2;
    for (uint32_t u : {b, mid - 1, mid, mid + 1}) {
      xs.push_back(bits_float(u));
      xs.push_back(-bits_float(u));
    }
  }
  for (uint32_t hi = 0; hi < 0x7F80u; hi += 7) {
    const uint32_t b = hi << 16;
    for (uint32_t u : {b + 0x7FFFu, b + 0x8000u, b + 0x8001u, b + 0x18000u}) xs.push_back(bits_float(u));
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) xs.push_back(bits_float(static_cast<uint32_t>(rng())));
  const auto n = static_cast<int64_t>(xs.size());
  for (DType d : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(d));
    Buffer p(n, 4, 1), g(n, 4, 1), lp(n, 2, 1);
    std::memcpy(p.data(), xs.data(), p.bytes());
    SgdArrays a;
    a.param = p.f32();
    a.grad = g.data();
    a.param_lowp = lp.data();
    a.lowp_dtype = d;
    a.n = n;
    SgdHyper h;
    h.lr = 0.0;
    sgd_step(h, a, path);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = d == DType::kBF16 ? float_to_bf16(xs[static_cast<size_t>(i)])
                                              : float_to_fp16(xs[static_cast<size_t>(i)]);
      if (lp.u16()[i] != want && bad++ < 4) {
        ADD_FAILURE() << "x=" << xs[static_cast<size_t>(i)] << " (0x" << std::hex
                      << float_bits(xs[static_cast<size_t>(i)]) << ") got 0x" << lp.u16()[i]
                      << " want 0x" << want;
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, ConversionTest, ::testing::ValuesIn(all_paths()),
                         [](const ::testing::TestParamInfo<SimdPath>& info) {
                           return std::string(simd_path_name(info.param));
                         });

TEST(SgdArgs, MomentumNeedsABuffer) {
  float p[2] = {1, 2}, g[2] = {1, 1};
  SgdArrays a;
  a.param = p;
  a.grad = g;
  a.n = 2;
  SgdHyper h;
  h.momentum = 0.9;
  EXPECT_THROW(sgd_step(h, a, SimdPath::kScalar), std::invalid_argument);
  EXPECT_THROW(sgd_step_ref(h, a), std::invalid_argument);
  h.momentum = 0.0;
  EXPECT_NO_THROW(sgd_step(h, a, SimdPath::kScalar));
  SgdArrays empty;
  EXPECT_NO_THROW(sgd_step(h, empty, best_simd_path()));
}

// torch.optim.SGD: the first momentum step clones the gradient (no dampening).
TEST(SgdSemantics, FirstMomentumStepClonesGrad) {
  float p[3] = {1, 1, 1}, buf[3] = {5, 5, 5}, g[3] = {1, -2, 4};
  SgdArrays a;
  a.param = p;
  a.momentum_buffer = buf;
  a.grad = g;
  a.n = 3;
  SgdHyper h;
  h.lr = 0.5;
  h.momentum = 0.9;
  h.dampening = 0.5;
  h.first_step = true;
  sgd_step(h, a, best_simd_path());
  EXPECT_EQ(buf[0], 1.0f);
  EXPECT_EQ(buf[1], -2.0f);
  EXPECT_EQ(p[2], -1.0f);
}

}  // namespace
}  // namespace superchip::ops::test
