// adam_step_recording + adam_undo: the recorded step gives adam_step's bits, and the undo
// restores every element of param, exp_avg, exp_avg_sq and param_lowp bit for bit, on every
// SIMD path, every grad x lowp dtype, Adam/AdamW/L2/maximize/other lerp form, first step
// (zero state) and later steps, over element classes chosen to defeat the prediction: zeros
// of both signs, denormals, huge and tiny updates, gradients far larger than the moments,
// NaN and infinity. Prints the exception rate on ordinary data (the cost of the undo log).
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "ops/cpu/AdamUndo.h"
#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

std::vector<AdamHyper> undo_variants() {
  std::vector<AdamHyper> v;
  AdamHyper h;
  v.push_back(h);  // Adam
  h.lr = 1e-2;
  h.weight_decay = 0.05;
  v.push_back(h);  // Adam + L2
  h = AdamHyper{};
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.1;
  h.lr = 3e-4;
  v.push_back(h);  // AdamW
  h = AdamHyper{};
  h.lr = 0.1;
  h.beta1 = 0.3;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.1;
  h.maximize = true;
  v.push_back(h);  // the other lerp form, maximize
  return v;
}

enum class Data { kOrdinary, kHostile };

float hostile_value(std::mt19937& rng, int64_t i) {
  const float denorm = std::numeric_limits<float>::denorm_min();
  switch (i % 11) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return denorm * static_cast<float>(1 + rng() % 1000);
    case 3: return -std::numeric_limits<float>::min() * 0.5f;
    case 4: return 3.0e38f;
    case 5: return 1e-30f;
    case 6: return std::numeric_limits<float>::quiet_NaN();
    case 7: return std::numeric_limits<float>::infinity();
    default: return std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  }
}

struct Arrays {
  Buffer p, m, v, g, lp;
  AdamArrays view(const DTypeCombo& c) {
    AdamArrays a;
    a.param = p.f32();
    a.exp_avg = m.f32();
    a.exp_avg_sq = v.f32();
    a.grad = g.data();
    a.grad_dtype = c.grad;
    a.param_lowp = c.has_lowp ? lp.data() : nullptr;
    a.lowp_dtype = c.lowp;
    a.n = p.size();
    return a;
  }
};

Arrays make(int64_t n, const DTypeCombo& c, Data data, bool zero_state, unsigned seed) {
  std::mt19937 rng(seed);
  Arrays s{Buffer(n, 4, 1), Buffer(n, 4, 3), Buffer(n, 4, 0), Buffer(n, dtype_size(c.grad), 5),
           Buffer(n, 2, 2)};
  fill_uniform(s.p, rng, -1.0f, 1.0f);
  fill_grad(s.g, c.grad, rng, -1e-2f, 1e-2f);
  if (!zero_state) {
    // Moments as training leaves them: exp_avg on the gradients' scale, exp_avg_sq near the
    // mean square gradient.
    fill_uniform(s.m, rng, -5e-3f, 5e-3f);
    std::uniform_real_distribution<float> ms(0.2e-4f, 0.6e-4f);
    for (int64_t i = 0; i < n; ++i) s.v.f32()[i] = ms(rng);
  }
  if (data == Data::kHostile) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = (i * 7 + seed) % 5;  // scatter the hostile classes over the fields
      if (k == 0) s.p.f32()[i] = hostile_value(rng, i);
      if (k == 1) s.m.f32()[i] = hostile_value(rng, i);
      if (k == 2) s.v.f32()[i] = std::fabs(hostile_value(rng, i));
      if (k == 3) {
        const float x = hostile_value(rng, i) * ((i % 3) ? 1.0f : 1e6f);
        if (c.grad == DType::kF32) {
          s.g.f32()[i] = x;
        } else if (c.grad == DType::kBF16) {
          s.g.u16()[i] = float_to_bf16(x);
        } else {
          s.g.u16()[i] = float_to_fp16(x);
        }
      }
    }
  }
  if (c.has_lowp) {
    for (int64_t i = 0; i < n; ++i) {
      s.lp.u16()[i] = c.lowp == DType::kBF16 ? float_to_bf16(s.p.f32()[i]) : float_to_fp16(s.p.f32()[i]);
    }
    if (data == Data::kHostile && n > 4) s.lp.u16()[n / 2] ^= 1;  // a lowp copy out of sync
  }
  return s;
}

class AdamUndoTest : public ::testing::TestWithParam<std::tuple<SimdPath, DTypeCombo>> {};

TEST_P(AdamUndoTest, RestoresEveryElementBitForBit) {
  const auto [path, combo] = GetParam();
  SUPERCHIP_SKIP_UNSUPPORTED(path);
  size_t elements = 0, escapes = 0, log_bytes = 0;
  for (const AdamHyper& base : undo_variants()) {
    for (int64_t step : {1, 7}) {
      for (Data data : {Data::kOrdinary, Data::kHostile}) {
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{1023}, int64_t{1025}, int64_t{5000}}) {
          AdamHyper h = base;
          h.step = step;
          const unsigned seed = static_cast<unsigned>(n * 31 + step);
          Arrays orig = make(n, combo, data, step == 1, seed);
          Arrays plain = make(n, combo, data, step == 1, seed);
          Arrays rec = make(n, combo, data, step == 1, seed);
          adam_step(h, plain.view(combo), path);
          AdamUndoLog log;
          adam_step_recording(h, rec.view(combo), path, &log);
          const std::string what = std::string(simd_path_name(path)) + " step " +
                                   std::to_string(step) + " n " + std::to_string(n) +
                                   (data == Data::kHostile ? " hostile" : " ordinary");
          ASSERT_TRUE(rec.p.same_bytes(plain.p) && rec.m.same_bytes(plain.m) &&
                      rec.v.same_bytes(plain.v) && (!combo.has_lowp || rec.lp.same_bytes(plain.lp)))
              << "recording changed the step's bits: " << what;
          adam_undo(h, rec.view(combo), log);
          ASSERT_TRUE(rec.p.same_bytes(orig.p)) << "param not restored: " << what;
          ASSERT_TRUE(rec.m.same_bytes(orig.m)) << "exp_avg not restored: " << what;
          ASSERT_TRUE(rec.v.same_bytes(orig.v)) << "exp_avg_sq not restored: " << what;
          if (combo.has_lowp) {
            ASSERT_TRUE(rec.lp.same_bytes(orig.lp)) << "param_lowp not restored: " << what;
          }
          ASSERT_TRUE(rec.p.guards_intact() && rec.m.guards_intact() && rec.v.guards_intact() &&
                      rec.lp.guards_intact());
          if (data == Data::kOrdinary && step == 7) {
            elements += static_cast<size_t>(n);
            escapes += static_cast<size_t>(log.escapes);
            log_bytes += static_cast<size_t>(log.bytes());
          }
        }
      }
    }
  }
  std::printf("[undo] %s: %zu side entries over %zu elements (%.3f%%), %.3f bytes/element\n",
              combo_name(path, combo).c_str(), escapes, elements,
              elements ? 100.0 * escapes / elements : 0.0,
              elements ? static_cast<double>(log_bytes) / elements : 0.0);
}

// The log's size on training-shaped data: parameters ~ N(0, 0.02), noise-dominated
// gradients ~ N(0, 1e-3) redrawn each step, AdamW at lr 3e-4. From step 3 on the log must
// stay within 1 byte per element (the engine's host memory target; step 2's exp_avg_sq, one
// gradient's square, is mostly lost in the next one's: about 1.2 bytes), and every recorded
// step must still undo exactly. bf16 gradients with a bf16 param_lowp copy and fp32 alone.
TEST(AdamUndo, LogWithinOneBytePerElementOnTrainingData) {
  for (const DTypeCombo combo : {DTypeCombo{DType::kF32, false, DType::kF32},
                                 DTypeCombo{DType::kBF16, true, DType::kBF16}}) {
    const int64_t n = 100000;
    std::mt19937 rng(7);
    std::normal_distribution<float> pd(0.0f, 0.02f), gd(0.0f, 1e-3f);
    Arrays s = make(n, combo, Data::kOrdinary, true, 1);
    for (int64_t i = 0; i < n; ++i) s.p.f32()[i] = pd(rng);
    if (combo.has_lowp) {
      for (int64_t i = 0; i < n; ++i) s.lp.u16()[i] = float_to_bf16(s.p.f32()[i]);
    }
    AdamHyper h;
    h.decoupled_weight_decay = true;
    h.weight_decay = 0.1;
    h.lr = 3e-4;
    double worst = 0.0;
    for (int64_t step = 1; step <= 30; ++step) {
      for (int64_t i = 0; i < n; ++i) {
        const float x = gd(rng);
        if (combo.grad == DType::kF32) {
          s.g.f32()[i] = x;
        } else {
          s.g.u16()[i] = float_to_bf16(x);
        }
      }
      h.step = step;
      const Arrays before = s;
      AdamUndoLog log;
      adam_step_recording(h, s.view(combo), active_simd_path(), &log);
      const Arrays stepped = s;
      adam_undo(h, s.view(combo), log);
      ASSERT_TRUE(s.p.same_bytes(before.p) && s.m.same_bytes(before.m) && s.v.same_bytes(before.v) &&
                  s.lp.same_bytes(before.lp))
          << "step " << step << " not restored";
      s = stepped;  // go on from the stepped state
      const double per_element = static_cast<double>(log.bytes()) / n;
      if (step >= 3) worst = std::max(worst, per_element);
      if (step <= 3 || step == 10 || step == 30) {
        std::printf("[undo] %s step %lld: %.3f bytes/element, %.4f side entries/element\n",
                    combo_name(SimdPath::kScalar, combo).c_str(), static_cast<long long>(step), per_element,
                    static_cast<double>(log.escapes) / n);
      }
    }
    EXPECT_LE(worst, 1.0) << "undo log above 1 byte per element from step 3 on";
  }
}

// A log that does not belong to the arrays is refused before anything is written.
TEST(AdamUndo, RejectsMismatchedLogWithoutWriting) {
  const DTypeCombo combo{DType::kF32, false, DType::kF32};
  Arrays s = make(3000, combo, Data::kHostile, false, 3);
  AdamHyper h;
  h.step = 4;
  AdamUndoLog log;
  adam_step_recording(h, s.view(combo), SimdPath::kScalar, &log);
  ASSERT_GT(log.side.size(), 0u);
  const Arrays stepped = s;
  auto refused = [&](const AdamUndoLog& bad, const AdamArrays& a) {
    EXPECT_THROW(adam_undo(h, a, bad), std::invalid_argument);
    EXPECT_TRUE(s.p.same_bytes(stepped.p) && s.m.same_bytes(stepped.m) && s.v.same_bytes(stepped.v));
  };
  AdamUndoLog truncated = log;
  truncated.side.pop_back();
  refused(truncated, s.view(combo));
  AdamUndoLog extra = log;
  extra.side.push_back(0);
  refused(extra, s.view(combo));
  AdamUndoLog recoded = log;
  for (uint8_t& c : recoded.codes) c = 0x33;  // every element claims side entries
  refused(recoded, s.view(combo));
  AdamArrays shorter = s.view(combo);
  shorter.n -= 2;
  refused(log, shorter);
}

TEST(AdamUndo, RejectsAmsgrad) {
  AdamHyper h;
  h.amsgrad = true;
  AdamArrays a;
  AdamUndoLog log;
  EXPECT_THROW(adam_step_recording(h, a, SimdPath::kScalar, &log), std::invalid_argument);
  EXPECT_THROW(adam_undo(h, a, log), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, AdamUndoTest,
                         ::testing::Combine(::testing::ValuesIn(all_paths()),
                                            ::testing::ValuesIn(all_dtype_combos())),
                         [](const auto& info) {
                           return combo_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

}  // namespace
}  // namespace superchip::ops::test
