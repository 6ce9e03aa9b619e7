"""Every loss type and option of ``objectives.policy_loss`` against the papers' formulas.

The golden values come from ``Paper``: plain-Python transcriptions of each paper's objective
(loops over floats, ``math.exp``; no torch, nothing from ``objectives``), on one batch of two
groups (G = 2, four completions) of three tokens, the third completion one token shorter.

``policy_loss`` sees that batch as one of the two micro-batches of an optimizer step
(``HALF_STEP`` normalisers), so its loss is half of the paper's batch loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.grpo import objectives as obj

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

# ---- the batch -----------------------------------------------------------------------------

# Completions 0, 1 answer prompt A, completions 2, 3 prompt B (G = 2).
ADVANTAGES = [1.2, -1.2, 0.5, -0.5]
MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
LOGPS = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7], [-0.9, -1.5, 50.0], [-2.2, -0.4, -1.1]]
# log r = logp - old_logp. Token level, clip [0.8, 1.28]: r[0][1] = 1.65 and r[2][0] = 1.35 are
# clipped high (A > 0),
# r[1][0] = 0.61 and r[3][1] = 0.74 are clipped low (A < 0); r[1][2] = 1.35 and r[3][0] = 1.49
# (A < 0) lie above delta = 1.3. The masked token (50 vs -50) is padding garbage.
LOG_RATIO = [[0.1, 0.5, -0.4], [-0.5, 0.05, 0.3], [0.3, -0.1, 100.0], [0.4, -0.3, 0.0]]
OLD_LOGPS = [
    [lp - lr for lp, lr in zip(row, lrs, strict=True)] for row, lrs in zip(LOGPS, LOG_RATIO, strict=True)
]
MAX_COMPLETION_LENGTH = 5

# This batch as one of two equal micro-batches of the optimizer step.
HALF_STEP = obj.Normalizers(
    tokens=2 * 11.0, sequences=2 * 4.0, accumulation=2, max_completion_length=MAX_COMPLETION_LENGTH
)
SEQ_EPS = {"epsilon_low": 0.03, "epsilon_high": 0.07}  # sequence ratios 1.069, 0.951, 1.105, 1.034

# ---- the papers, transcribed -----------------------------------------------------------------


def lengths() -> list[int]:
    return [sum(row) for row in MASK]


def tokens(i: int) -> list[int]:
    """Indices of completion i's loss-counted tokens."""
    return [t for t, m in enumerate(MASK[i]) if m]


def clip(x: float, low: float, high: float) -> float:
    return max(low, min(x, high))


class Paper:
    """The papers' objectives on (LOGPS, OLD_LOGPS, ADVANTAGES, MASK), as losses (negated)."""

    def __init__(self, logps: list[list[float]]):
        self.logps = logps
        self.g = len(ADVANTAGES)
        self.n_tokens = sum(lengths())

    def log_ratio(self, i: int, t: int) -> float:
        return self.logps[i][t] - OLD_LOGPS[i][t]

    def token_ratio(self, i: int, t: int) -> float:
        """w_it = pi(o_it) / pi_old(o_it)."""
        return math.exp(self.log_ratio(i, t))

    def sequence_ratio(self, i: int) -> float:
        """GSPO eq. 7: s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|)."""
        log_pi = sum(self.log_ratio(i, t) for t in tokens(i))
        return math.exp(log_pi / len(tokens(i)))

    def ratio(self, i: int, t: int, level: str) -> float:
        return self.token_ratio(i, t) if level == "token" else self.sequence_ratio(i)

    def ppo_term(self, i, t, level, eps_low, eps_high, delta) -> float:
        """DeepSeekMath eq. 3 / DAPO eq. 8 per token; INTELLECT-2's two-sided clip when delta:
        min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
        r, a = self.ratio(i, t, level), ADVANTAGES[i]
        capped = r if delta is None else min(r, delta)
        return min(capped * a, clip(r, 1 - eps_low, 1 + eps_high) * a)

    def grpo(self, level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None) -> float:
        """DeepSeekMath eq. 3: -1/G sum_i 1/|o_i| sum_t term_it (GSPO eq. 5 at sequence level)."""
        total = 0.0
        for i in range(self.g):
            terms = [self.ppo_term(i, t, level, epsilon_low, epsilon_high, delta) for t in tokens(i)]
            total += sum(terms) / len(terms)
        return -total / self.g

    def token_sum(self, level, epsilon_low, epsilon_high, delta) -> float:
        return sum(
            self.ppo_term(i, t, level, epsilon_low, epsilon_high, delta)
            for i in range(self.g)
            for t in tokens(i)
        )

    def dapo(self, level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None) -> float:
        """DAPO eq. 8: -1/sum_i |o_i| sum_i sum_t term_it."""
        return -self.token_sum(level, epsilon_low, epsilon_high, delta) / self.n_tokens

    def bnpo(self, level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None) -> float:
        """BNPO: the token mean over the local batch (this whole batch here)."""
        return -self.token_sum(level, epsilon_low, epsilon_high, delta) / self.n_tokens

    def dr_grpo(self, level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None) -> float:
        """Dr. GRPO (Sec. 3.2): -1/(G L_max) sum_i sum_t term_it, L_max = max_completion_length."""
        denominator = self.g * MAX_COMPLETION_LENGTH
        return -self.token_sum(level, epsilon_low, epsilon_high, delta) / denominator

    def luspo(self, epsilon_low=0.2, epsilon_high=0.2, delta=None) -> float:
        """LUSPO: GSPO eq. 5 with each sequence's term scaled by |o_i|:
        -1/G sum_i |o_i| min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)."""
        total = 0.0
        for i in range(self.g):
            t0 = tokens(i)[0]  # the sequence term is the same on every token
            total += len(tokens(i)) * self.ppo_term(i, t0, "sequence", epsilon_low, epsilon_high, delta)
        return -total / self.g

    def cispo(self, level="token", epsilon_high=5.0) -> float:
        """ScaleRL's CISPO: -1/sum|o_i| sum_i sum_t sg(min(r_it, eps_max)) A_i log pi(o_it)."""
        total = 0.0
        for i in range(self.g):
            for t in tokens(i):
                weight = min(self.ratio(i, t, level), epsilon_high)
                total += weight * ADVANTAGES[i] * self.logps[i][t]
        return -total / self.n_tokens

    def sapo(self, level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05) -> float:
        """SAPO Sec. 3: -1/G sum_i 1/|o_i| sum_t f(r_it) A_i, f(x) = sigmoid(tau (x - 1)) 4 / tau,
        tau = tau_pos if A_i > 0 else tau_neg."""
        total = 0.0
        for i in range(self.g):
            a = ADVANTAGES[i]
            tau = sapo_temperature_pos if a > 0 else sapo_temperature_neg
            gates = [4 / tau / (1 + math.exp(-tau * (self.ratio(i, t, level) - 1))) for t in tokens(i)]
            total += sum(gate * a for gate in gates) / len(gates)
        return -total / self.g

    def vespo_phi(self, i, k_pos, lambda_pos, k_neg, lambda_neg) -> float:
        """VESPO Sec. 3.4: phi(W) = W^k exp(lambda (1 - W)), W = pi(o_i) / mu(o_i) (no 1/|o_i|)."""
        w = math.exp(sum(self.log_ratio(i, t) for t in tokens(i)))
        k, lam = (k_pos, lambda_pos) if ADVANTAGES[i] > 0 else (k_neg, lambda_neg)
        return w**k * math.exp(lam * (1 - w))

    def vespo(self, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0) -> float:
        """VESPO: -sum_i sg(phi_i) A_i log pi(o_i), normalised by the batch's token count."""
        total = 0.0
        for i in range(self.g):
            phi = self.vespo_phi(i, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
            total += phi * ADVANTAGES[i] * sum(self.logps[i][t] for t in tokens(i))
        return -total / self.n_tokens

    def gmpo(self, epsilon_low=0.4, epsilon_high=0.4) -> float:
        """GMPO's J_GMPO: -1/G sum_i (prod_t min[w^s, clip(w^s, e1, e2)]^s)^(1/|o_i|) A_i with
        s = sgn(A_i), (e1, e2) = (exp(-epsilon_low), exp(epsilon_high))."""
        e1, e2 = math.exp(-epsilon_low), math.exp(epsilon_high)
        total = 0.0
        for i in range(self.g):
            s = 1.0 if ADVANTAGES[i] > 0 else -1.0
            product = 1.0
            for t in tokens(i):
                w_s = self.token_ratio(i, t) ** s
                product *= min(w_s, clip(w_s, e1, e2)) ** s
            total += product ** (1 / len(tokens(i))) * ADVANTAGES[i]
        return -total / self.g


# (loss_type, ObjectiveSettings fields): every loss type, both levels where allowed, delta.
CASES = [
    ("grpo", {"epsilon_low": 0.2, "epsilon_high": 0.28}),
    ("dapo", {"epsilon_low": 0.2, "epsilon_high": 0.28}),
    ("bnpo", {"epsilon_low": 0.2, "epsilon_high": 0.28}),
    ("dr_grpo", {"epsilon_low": 0.2, "epsilon_high": 0.28}),
    ("grpo", {"importance_sampling_level": "sequence", **SEQ_EPS}),
    ("dapo", {"importance_sampling_level": "sequence", **SEQ_EPS}),
    ("bnpo", {"importance_sampling_level": "sequence", **SEQ_EPS}),
    ("dr_grpo", {"importance_sampling_level": "sequence", **SEQ_EPS}),
    ("grpo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3}),
    ("dapo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3}),
    ("bnpo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3}),
    ("dr_grpo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3}),
    (
        "dapo",
        {"importance_sampling_level": "sequence", "epsilon_low": 0.03, "epsilon_high": 0.01, "delta": 1.02},
    ),
    ("luspo", {"importance_sampling_level": "sequence", **SEQ_EPS}),
    (
        "luspo",
        {"importance_sampling_level": "sequence", "epsilon_low": 0.03, "epsilon_high": 0.01, "delta": 1.02},
    ),
    ("cispo", {"epsilon_high": 5.0}),
    ("cispo", {"epsilon_high": 1.3}),
    ("cispo", {"importance_sampling_level": "sequence", "epsilon_high": 1.06}),
    ("sapo", {}),
    ("sapo", {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    ("sapo", {"importance_sampling_level": "sequence", "sapo_temperature_pos": 3.0}),
    ("vespo", {}),
    ("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 5.0}),
    ("gmpo", {"epsilon_low": 0.4, "epsilon_high": 0.4}),
    ("gmpo", {"epsilon_low": 0.2, "epsilon_high": 0.2}),
]
CASE_IDS = [f"{lt}-" + "-".join(f"{k}={v}" for k, v in kw.items()) for lt, kw in CASES]

# Where the paper's formula stops a gradient, the loss's gradient is not that of its value.
STOPS_GRADIENT = {"cispo", "vespo"}


def paper_loss(loss_type: str, fields: dict, logps: list[list[float]] = LOGPS) -> float:
    """The paper's loss of the batch, from ObjectiveSettings-style fields."""
    kwargs = dict(fields)
    level = kwargs.pop("importance_sampling_level", "token")
    if len(obj.LOSS_TYPES[loss_type].levels) > 1:  # the single-level losses take no level argument
        kwargs["level"] = level
    return getattr(Paper(logps), loss_type)(**kwargs)


# ---- helpers -------------------------------------------------------------------------------


def batch(dtype=torch.float64):
    logps = torch.tensor(LOGPS, dtype=dtype, requires_grad=True)
    return (
        logps,
        torch.tensor(OLD_LOGPS, dtype=dtype),
        torch.tensor(ADVANTAGES, dtype=dtype),
        torch.tensor(MASK),
    )


def run(loss_type: str, fields: dict, dtype=torch.float64, norms: obj.Normalizers = HALF_STEP):
    logps, old, adv, mask = batch(dtype)
    settings = obj.ObjectiveSettings(loss_type=loss_type, **fields)
    loss, stats = obj.policy_loss(logps, old, adv, mask, settings, norms)
    loss.backward()
    return loss.detach(), logps.grad, stats


def close(actual: torch.Tensor, expected, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def finite_difference_grad(loss_type: str, fields: dict, h: float = 1e-6) -> list[list[float]]:
    """d paper_loss / d logp_it by central differences (0 on masked tokens)."""
    grad = [[0.0] * len(row) for row in LOGPS]
    for i in range(len(LOGPS)):
        for t in tokens(i):
            up = [row[:] for row in LOGPS]
            down = [row[:] for row in LOGPS]
            up[i][t] += h
            down[i][t] -= h
            grad[i][t] = (paper_loss(loss_type, fields, up) - paper_loss(loss_type, fields, down)) / (2 * h)
    return grad


# ---- golden values and gradients -------------------------------------------------------------


def test_batch_hits_the_regions_the_cases_need():
    """Guards the fixture: which ratios sit outside which bounds (see the comments above)."""
    paper = Paper(LOGPS)
    seq = [paper.sequence_ratio(i) for i in range(4)]
    close(torch.tensor(seq, dtype=torch.float64), [math.exp(x) for x in (0.2 / 3, -0.05, 0.1, 0.1 / 3)])
    assert seq[0] < 1.07 < seq[2] and seq[1] < 0.97 < seq[3] < 1.04
    assert (
        paper.token_ratio(0, 1) > 1.28
        and paper.token_ratio(2, 0) > 1.28
        and paper.token_ratio(1, 0) < 0.8
        and paper.token_ratio(3, 1) < 0.8
    )
    assert paper.token_ratio(1, 2) > 1.3 and paper.token_ratio(3, 0) > 1.3


@pytest.mark.parametrize(("loss_type", "fields"), CASES, ids=CASE_IDS)
def test_golden_loss_matches_paper(loss_type, fields):
    """policy_loss on half of a step is half the paper's batch loss, for every case."""
    loss, _, _ = run(loss_type, fields)
    close(loss, paper_loss(loss_type, fields) / 2)


@pytest.mark.parametrize(("loss_type", "fields"), CASES, ids=CASE_IDS)
def test_golden_loss_float32(loss_type, fields):
    """The same in float32 (the padding's log-ratio 100 overflows exp there: it must not leak)."""
    loss, grad, _ = run(loss_type, fields, dtype=torch.float32)
    close(loss, paper_loss(loss_type, fields) / 2, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    ("loss_type", "fields"),
    [c for c in CASES if c[0] not in STOPS_GRADIENT],
    ids=[i for i, c in zip(CASE_IDS, CASES, strict=True) if c[0] not in STOPS_GRADIENT],
)
def test_gradient_is_that_of_the_paper_objective(loss_type, fields):
    """Where no gradient is stopped, autograd equals the finite-difference gradient of the
    paper's objective. At sequence level that objective uses the true s_i = exp(mean log r), so
    this checks that the per-token form has GSPO's gradient (eq. 10)."""
    _, grad, _ = run(loss_type, fields)
    expected = [[g / 2 for g in row] for row in finite_difference_grad(loss_type, fields)]
    close(grad, expected, rtol=1e-5, atol=1e-8)


def test_gspo_gradient_eq10_by_hand():
    """GSPO eq. 10: grad J = 1/G sum_i s_i A_i (1/|o_i|) sum_t grad log pi(o_it), zero for a
    sequence whose s_i is clipped (A > 0 and s_i > 1 + eps_high, or A < 0 and s_i < 1 - eps_low).

    With SEQ_EPS ([0.97, 1.07]) completions 1 (0.951, A < 0) and 2 (1.105, A > 0) are clipped; the
    loss (negated J) has gradient -s_i A_i / (|o_i| G) on the others' tokens; G = 8 (half step).
    """
    fields = {"importance_sampling_level": "sequence", **SEQ_EPS}
    _, grad, _ = run("grpo", fields)
    paper = Paper(LOGPS)
    expected = [[0.0] * 3 for _ in range(4)]
    for i in (0, 3):
        s = paper.sequence_ratio(i)
        for t in tokens(i):
            expected[i][t] = -s * ADVANTAGES[i] / (len(tokens(i)) * 8)
    close(grad, expected)


def test_gspo_per_token_form_equals_naive_sequence_ratio_autograd():
    """The detached per-token form and a direct exp(masked mean) with gradient agree in value
    and gradient, for every reduction."""
    torch.manual_seed(0)
    logps0 = torch.randn(4, 5, dtype=torch.float64) * 0.3 - 1.0
    old = logps0 + torch.randn(4, 5, dtype=torch.float64) * 0.05
    adv = torch.tensor([1.0, -0.5, 0.3, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    m = mask.to(torch.float64)
    eps_low, eps_high = 0.02, 0.03
    norms = obj.Normalizers(tokens=13.0, sequences=4.0, accumulation=1, max_completion_length=6)
    for loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo"):
        logps = logps0.clone().requires_grad_(True)
        settings = obj.ObjectiveSettings(
            loss_type=loss_type,
            importance_sampling_level="sequence",
            epsilon_low=eps_low,
            epsilon_high=eps_high,
        )
        loss, _ = obj.policy_loss(logps, old, adv, mask, settings, norms)
        loss.backward()

        naive_logps = logps0.clone().requires_grad_(True)
        s = torch.exp(((naive_logps - old) * m).sum(1) / m.sum(1))  # [B], gradient through the mean
        seq_loss = -torch.min(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)  # [B]
        lengths_ = m.sum(1)
        naive = {
            "grpo": seq_loss.sum() / 4.0,
            "dapo": (seq_loss * lengths_).sum() / 13.0,
            "bnpo": (seq_loss * lengths_).sum() / lengths_.sum(),
            "dr_grpo": (seq_loss * lengths_).sum() / (4.0 * 6),
            "luspo": (seq_loss * lengths_).sum() / 4.0,
        }[loss_type]
        naive.backward()
        close(loss.detach(), naive.detach())
        close(logps.grad, naive_logps.grad)


# ---- where the formula stops gradients --------------------------------------------------------


@pytest.mark.parametrize("fields", [{"epsilon_high": 1.3}, {"epsilon_high": 5.0}])
def test_cispo_gradient_is_detached_weight_times_advantage(fields):
    """d loss / d logp_it = -sg(min(r_it, eps_max)) A_i / denominator (22 tokens, half step):
    the weight's own dependence on logp is stopped, and truncated tokens keep their gradient."""
    _, grad, _ = run("cispo", fields)
    paper = Paper(LOGPS)
    expected = [[0.0] * 3 for _ in range(4)]
    for i in range(4):
        for t in tokens(i):
            expected[i][t] = -min(paper.token_ratio(i, t), fields["epsilon_high"]) * ADVANTAGES[i] / 22.0
    close(grad, expected)
    assert (grad[torch.tensor(MASK) > 0] != 0).all()


def test_vespo_gradient_has_phi_detached():
    """d loss / d logp_it = -phi_i A_i / denominator: phi(W) is a constant coefficient."""
    _, grad, _ = run("vespo", {})
    paper = Paper(LOGPS)
    expected = [[0.0] * 3 for _ in range(4)]
    for i in range(4):
        phi = paper.vespo_phi(i, 2.0, 3.0, 3.0, 2.0)
        for t in tokens(i):
            expected[i][t] = -phi * ADVANTAGES[i] / 22.0
    close(grad, expected)


# ---- limit cases ---------------------------------------------------------------------------


def on_policy_denominators(norms: obj.Normalizers, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token divisor of -A_i in the REINFORCE gradient, per loss type: [B, 1] or scalar."""
    lengths_ = mask.sum(1, keepdim=True).double()
    per_sequence = lengths_ * norms.sequences
    return {
        "grpo": per_sequence,
        "dapo": torch.tensor(norms.tokens),
        "bnpo": mask.sum().double() * norms.accumulation,
        "dr_grpo": torch.tensor(norms.sequences * norms.max_completion_length),
        "cispo": torch.tensor(norms.tokens),
        "gmpo": per_sequence,
        "sapo": per_sequence,
        "vespo": torch.tensor(norms.tokens),
        "luspo": torch.tensor(norms.sequences),
    }


def test_every_loss_type_has_its_independent_expectations():
    """A new ``LOSS_TYPES`` row fails here until its paper loss and its on-policy gradient
    denominator are written out by hand below (the expectations must not come from the table)."""
    assert set(on_policy_denominators(HALF_STEP, torch.ones(2, 3))) == set(obj.LOSS_TYPES)
    assert all(callable(getattr(Paper, name, None)) for name in obj.LOSS_TYPES)
    assert {name for name, _ in CASES} == set(obj.LOSS_TYPES)


@pytest.mark.parametrize("loss_type", list(obj.LOSS_TYPES))
def test_ratio_one_is_advantage_weighted_log_likelihood_gradient(loss_type):
    """old = logps.detach(): every ratio (and W, phi) is 1 and the gradient is REINFORCE's,
    -A_i * grad logp_it / denominator (luspo: |o_i| * (1/|o_i|) per token over sequences)."""
    torch.manual_seed(3)
    logps = (torch.randn(3, 4, dtype=torch.float64) - 1.5).requires_grad_(True)
    adv = torch.tensor([0.8, -1.1, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    norms = obj.Normalizers(tokens=17.0, sequences=6.0, accumulation=2, max_completion_length=7)
    level = "sequence" if loss_type == "luspo" else "token"
    eps_high = 5.0 if loss_type == "cispo" else 0.2  # cispo: eps_max, as the trainer passes it
    settings = obj.ObjectiveSettings(
        loss_type=loss_type, importance_sampling_level=level, epsilon_high=eps_high
    )
    loss, _ = obj.policy_loss(logps, logps.detach(), adv, mask, settings, norms)
    loss.backward()
    expected = -adv.unsqueeze(1) * mask.double() / on_policy_denominators(norms, mask)[loss_type]
    close(logps.grad, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo"])
def test_sequence_level_equals_token_level_for_one_token_completions(loss_type):
    """With one token per completion, s_i = r_i1: same loss, gradient and statistics."""
    torch.manual_seed(4)
    logps0 = torch.randn(4, 3, dtype=torch.float64) - 1.0
    old = logps0 + torch.randn(4, 3, dtype=torch.float64) * 0.4
    adv = torch.tensor([1.0, -1.0, 0.6, -0.6], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])
    norms = obj.Normalizers(tokens=4.0, sequences=4.0, max_completion_length=3)
    results = []
    for level in ("token", "sequence"):
        logps = logps0.clone().requires_grad_(True)
        settings = obj.ObjectiveSettings(
            loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.1, epsilon_high=0.2
        )
        loss, stats = obj.policy_loss(logps, old, adv, mask, settings, norms)
        loss.backward()
        results.append((loss.detach(), logps.grad, stats))
    (loss_t, grad_t, stats_t), (loss_s, grad_s, stats_s) = results
    close(loss_s, loss_t)
    close(grad_s, grad_t)
    for key in stats_t:
        close(stats_s[key], stats_t[key])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_delta_none_is_the_plain_clip(level):
    """delta=None is clipped_surrogate without cap, and a delta above every ratio changes nothing."""
    fields = {"importance_sampling_level": level, "epsilon_low": 0.2, "epsilon_high": 0.28}
    loss_none, grad_none, _ = run("dapo", fields)
    loss_big, grad_big, _ = run("dapo", {**fields, "delta": 1e9})
    close(loss_none, loss_big)
    close(grad_none, grad_big)
    if level == "token":
        logps, old, adv, mask = batch()
        plain = obj.clipped_surrogate(logps, old, adv, 0.2, 0.28) * mask
        close(loss_none, plain.sum().detach() / HALF_STEP.tokens)


def test_delta_caps_only_negative_advantages_when_above_the_clip():
    """delta = 1.3 >= 1 + eps_high: tokens with A > 0 are unchanged; r = 1.35 and 1.49 with A < 0
    are capped (loss -1.3 A, no gradient), the rest unchanged."""
    logps, old, adv, _ = batch()
    plain = obj.clipped_surrogate(logps, old, adv, 0.2, 0.28)
    capped = obj.clipped_surrogate(logps, old, adv, 0.2, 0.28, delta=1.3)
    close(capped[[0, 2]], plain[[0, 2]].detach())
    close(capped[1, 2], torch.tensor(1.3 * 1.2, dtype=torch.float64))
    close(capped[3, 0], torch.tensor(1.3 * 0.5, dtype=torch.float64))
    close(capped[1, :2], plain[1, :2].detach())
    (grad,) = torch.autograd.grad(capped[[1, 3], [2, 0]].sum(), logps)
    assert (grad == 0).all()


def test_gmpo_asymmetric_range_floors_negative_advantages_at_minus_epsilon_low():
    """Documented departure: for A < 0 the log-ratio floor is -epsilon_low (TRL's GMPO), where the
    paper's sgn form with (e^-eps_low, e^eps_high) would floor at -epsilon_high.

    Completion 1 (A = -1.2), log r = [-0.5, 0.05, 0.3], eps_low 0.1: clipped [-0.1, 0.05, 0.3],
    mean 0.25/3; completion 3 (A = -0.5), log r = [0.4, -0.3, 0.0]: [0.4, -0.1, 0.0], mean 0.1.
    """
    logps, old, adv, mask = batch()
    per_token = obj.gmpo_surrogate(logps, old, adv, 0.1, 0.4, mask=mask.double())
    close(per_token[1, 0].detach(), torch.tensor(1.2 * math.exp(0.25 / 3), dtype=torch.float64))
    close(per_token[3, 0].detach(), torch.tensor(0.5 * math.exp(0.1), dtype=torch.float64))


# ---- statistics ----------------------------------------------------------------------------


def expected_keys(loss_type: str) -> set[str]:
    extra = {"cispo": {"cispo_clip"}, "vespo": {"vespo_phi"}}.get(loss_type, set())
    return {"low", "high", "region", "tokens"} | extra


@pytest.mark.parametrize(("loss_type", "fields"), CASES, ids=CASE_IDS)
def test_stats_keys_shapes_and_no_gradient(loss_type, fields):
    _, _, stats = run(loss_type, fields)
    assert set(stats) == expected_keys(loss_type)
    for value in stats.values():
        assert value.shape == (4,)
        assert not value.requires_grad
    close(stats["tokens"], [3.0, 3.0, 2.0, 3.0])


def test_stats_token_level_clip_region():
    """Clip [0.8, 1.28]: completion 0 (A > 0) has 1.65 high (1/3); completion 2 (A > 0) has 1.35
    high (1/2); completion 1 (A < 0) has 0.61 low (1/3); completion 3 (A < 0) has 0.74 low (1/3).
    The delta cap (1.35 and 1.49 with A < 0) is not a trust-region clip and is not counted."""
    _, _, stats = run("grpo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3})
    close(stats["low"], [0.0, 1 / 3, 0.0, 1 / 3])
    close(stats["high"], [1 / 3, 0.0, 1 / 2, 0.0])
    close(stats["region"], [1 / 3, 1 / 3, 1 / 2, 1 / 3])


@pytest.mark.parametrize("loss_type", ["grpo", "luspo"])
def test_stats_sequence_level_are_zero_or_one(loss_type):
    """Region [0.97, 1.07] on s = [1.069, 0.951, 1.105, 1.034]: completion 1 low (A < 0),
    completion 2 high (A > 0)."""
    _, _, stats = run(loss_type, {"importance_sampling_level": "sequence", **SEQ_EPS})
    close(stats["low"], [0.0, 1.0, 0.0, 0.0])
    close(stats["high"], [0.0, 0.0, 1.0, 0.0])
    close(stats["region"], [0.0, 1.0, 1.0, 0.0])


def test_stats_gmpo_count_the_log_space_region():
    """Log-space region [-0.2, 0.2]: completion 0 (A > 0) log r 0.5 high; completion 2 (A > 0)
    0.3 high; completion 1 (A < 0) -0.5 low; completion 3 (A < 0) -0.3 low."""
    _, _, stats = run("gmpo", {"epsilon_low": 0.2, "epsilon_high": 0.2})
    close(stats["high"], [1 / 3, 0.0, 1 / 2, 0.0])
    close(stats["low"], [0.0, 1 / 3, 0.0, 1 / 3])


def test_stats_cispo_clip_counts_truncated_positive_advantage_tokens():
    """eps_max = 1.3: truncated r = 1.65 (completion 0, A > 0) and 1.35 (completion 2, A > 0)
    count; 1.35 and 1.49 (A < 0) are truncated but not counted. CISPO has no hard clip:
    low/high/region are 0. At sequence level (eps_max 1.06) s = 1.069 and 1.105 (A > 0) count."""
    _, _, stats = run("cispo", {"epsilon_high": 1.3})
    close(stats["cispo_clip"], [1 / 3, 0.0, 1 / 2, 0.0])
    for key in ("low", "high", "region"):
        close(stats[key], [0.0] * 4)
    _, _, stats = run("cispo", {"importance_sampling_level": "sequence", "epsilon_high": 1.06})
    close(stats["cispo_clip"], [1.0, 0.0, 1.0, 0.0])


def test_stats_vespo_phi_is_the_gamma_weight():
    fields = {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 5.0}
    _, _, stats = run("vespo", fields)
    paper = Paper(LOGPS)
    close(stats["vespo_phi"], [paper.vespo_phi(i, 1.0, 0.5, 4.0, 5.0) for i in range(4)])
    for key in ("low", "high", "region"):
        close(stats[key], [0.0] * 4)


def test_stats_sapo_have_no_clip():
    _, _, stats = run("sapo", {})
    for key in ("low", "high", "region"):
        close(stats[key], [0.0] * 4)


# ---- errors and the table ------------------------------------------------------------------


def test_unknown_loss_type_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="'ppo'"):
        run("ppo", {})


def test_luspo_needs_sequence_level():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        run("luspo", {"importance_sampling_level": "token"})


@pytest.mark.parametrize("loss_type", ["vespo", "gmpo"])
def test_token_only_losses_reject_sequence_level(loss_type):
    with pytest.raises(ValueError, match="importance_sampling_level"):
        run(loss_type, {"importance_sampling_level": "sequence"})


def test_unknown_importance_level_raises():
    with pytest.raises(ValueError, match="importance_sampling_level='tok'"):
        run("dapo", {"importance_sampling_level": "tok"})


def test_table_composition():
    """Each loss type is one row: its term and reduction."""
    rows = {name: (spec.term, spec.reduction) for name, spec in obj.LOSS_TYPES.items()}
    assert rows == {
        "grpo": (obj.clipped_surrogate, "sequence"),
        "dapo": (obj.clipped_surrogate, "token"),
        "bnpo": (obj.clipped_surrogate, "token_local"),
        "dr_grpo": (obj.clipped_surrogate, "fixed_length"),
        "luspo": (obj.clipped_surrogate, "sequence_sum"),
        "cispo": (obj.cispo_surrogate, "token"),
        "sapo": (obj.sapo_surrogate, "sequence"),
        "vespo": (obj.vespo_surrogate, "token"),
        "gmpo": (obj.gmpo_surrogate, "sequence"),
    }
    for spec in obj.LOSS_TYPES.values():
        assert spec.reduction in obj.REDUCTIONS
        assert spec.clip_region in obj.CLIP_REGIONS
        assert all(hasattr(obj.ObjectiveSettings(), name) for name in spec.hyper)
