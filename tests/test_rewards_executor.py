"""RewardExecutor: bounded time per sample in worker processes, ordered and deterministic results, errors that name
the sample, the in-process fallback, and MathReward's own time bound (guard + executor backstop). CPU only.

Worker pools are started once per test module (fixtures) because starting processes on a small machine is slow.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from _reward_helpers import (
    DIE,
    HANG,
    RAISE,
    FailingReward,
    SleepyReward,
    UnloadableReward,
    count_reward,
    scalar_reward,
    text_reward,
    two_argument_reward,
)
from rlexact.rewards import (
    MathReward,
    RewardConfig,
    RewardError,
    RewardExecutor,
    RewardResult,
    check_rewards,
    close_shared_executors,
    explosion_reason,
    resolve_reward,
    shared_executor,
)

TOWER = r"\boxed{9^{9^{9^{9}}}}"
TOWER_AT = 17
N = 64
LIMIT_S = 2.0
SLACK_S = 5.0

# the guard is off so that only the executor can bound the tower's time; direct calls use a 2-worker shared pool
UNGUARDED = MathReward(max_digits=None, time_limit_s=LIMIT_S, workers=2)


def math_batch(tower: bool = True) -> tuple[list[str], list[str], list[str]]:
    """64 completions with a mix of right and wrong answers (boxed, plain numbers, fractions), the tower at 17."""
    prompts = [f"q{k}" for k in range(N)]
    completions, answers = [], []
    for k in range(N):
        if k % 4 == 0:
            completions.append(f"so the answer is \\boxed{{\\frac{{{k}}}{{2}}}}")
            answers.append(str(k / 2))
        elif k % 4 == 1:
            completions.append(f"first 3 then {k}")
            answers.append(str(k + k % 3 - 1))  # right for k % 3 == 1
        elif k % 4 == 2:
            completions.append(f"\\boxed{{{k}^{{2}}}}")
            answers.append(str(k * k if k % 3 else k))
        else:
            completions.append(f"\\boxed{{x^{{{k % 5}}} + 1}}")
            answers.append(f"1 + x^{k % 5}")
    if tower:
        completions[TOWER_AT] = TOWER
    return prompts, completions, answers


def serial_scores(prompts, completions, answers) -> list[float]:
    """The reference: MathReward.score of each sample in this process (guard on, so the tower scores 0 here too)."""
    ref = MathReward(time_limit_s=None)
    return [ref.score(p, c, a) for p, c, a in zip(prompts, completions, answers)]


@pytest.fixture(scope="module")
def math_pool():
    ex = shared_executor(UNGUARDED, workers=2, timeout_s=LIMIT_S)  # the pool UNGUARDED(...) itself uses
    ex.run(["w"], ["\\boxed{1}"], ["1"])  # start the workers outside the timed tests
    yield ex
    close_shared_executors()


@pytest.fixture(scope="module")
def sleepy_pool():
    with RewardExecutor(SleepyReward(), workers=2, timeout_s=1.0, timeout_value=-1.0) as ex:
        ex.run(["w"], ["w"], [None])
        yield ex


@pytest.fixture(scope="module")
def failing_pool():
    with RewardExecutor(FailingReward(), workers=2, timeout_s=LIMIT_S) as ex:
        ex.run(["w"], ["w"], [None])
        yield ex


def test_power_tower_times_out_alone(math_pool):
    prompts, completions, answers = math_batch()
    ref = serial_scores(prompts, completions, answers)
    assert 0.0 < sum(ref) < N - 1  # the batch has right and wrong answers
    t0 = time.monotonic()
    result = math_pool.run(prompts, completions, answers)
    elapsed = time.monotonic() - t0
    assert elapsed < LIMIT_S + SLACK_S
    assert elapsed >= LIMIT_S  # it really waited for the limit: the guard is off in this reward
    assert result.timeouts == [TOWER_AT] and result.errors == []
    assert result.rewards[TOWER_AT] == math_pool.config.timeout_value == 0.0
    assert result.rewards == ref  # every other sample has its normal reward, in order
    assert result.metrics()["reward/timeouts"] == 1.0
    assert result.metrics()["reward/timeout_frac"] == 1.0 / N
    assert "9^{9^{9^{9}}}" in result.timeout_example and f"sample {TOWER_AT}" in result.timeout_example
    # the killed worker was replaced: the pool still scores, with both workers
    again = math_pool.run(*math_batch(tower=False))
    assert again.timeouts == [] and len(math_pool._pool.procs) == 2


def test_math_reward_direct_call_is_bounded(math_pool):
    prompts, completions, answers = math_batch()
    t0 = time.monotonic()
    got = UNGUARDED(prompts, completions, answers)  # through the shared executor (the backstop)
    assert time.monotonic() - t0 < LIMIT_S + SLACK_S
    assert got == serial_scores(prompts, completions, answers)
    # the guard alone (no workers) bounds the tower too, and fast
    t0 = time.monotonic()
    assert MathReward(time_limit_s=None)(prompts, completions, answers) == got
    assert time.monotonic() - t0 < SLACK_S


def test_sleeping_user_reward_times_out(sleepy_pool):
    completions = [f"c{'x' * k}" for k in range(N)]
    completions[5] = f"please {HANG} here"
    t0 = time.monotonic()
    result = sleepy_pool.run(["p"] * N, completions, [None] * N)
    assert time.monotonic() - t0 < 1.0 + SLACK_S
    assert result.timeouts == [5]
    assert result.rewards[5] == -1.0
    assert [r for k, r in enumerate(result.rewards) if k != 5] == [
        float(len(c) % 5) for k, c in enumerate(completions) if k != 5
    ]
    assert result.metrics()["reward/timeouts"] == 1.0


def test_submit_returns_at_once_and_keeps_order(sleepy_pool):
    first = [f"a{'x' * k}" for k in range(40)]
    first[3] = HANG
    second = [f"b{'y' * k}" for k in range(23)]
    t0 = time.monotonic()
    fut1 = sleepy_pool.submit(["p"] * 40, first, [None] * 40)
    fut2 = sleepy_pool.submit(["p"] * 23, second, [None] * 23)
    assert time.monotonic() - t0 < 0.5 and not fut1.done()  # the caller is free while the workers score
    r1, r2 = fut1.result(timeout=1.0 + SLACK_S), fut2.result(timeout=SLACK_S)
    assert r1.timeouts == [3] and r2.timeouts == []
    assert r2.rewards == [float(len(c) % 5) for c in second]
    both = RewardResult.concat([r1, r2])
    assert both.timeouts == [3] and len(both.rewards) == 63 and both.rewards[40:] == r2.rewards


def test_same_results_with_1_and_n_workers(math_pool):
    prompts, completions, answers = math_batch(tower=False)  # 4 chunks of 16 over the workers
    with RewardExecutor(MathReward(), workers=1, timeout_s=LIMIT_S) as one:
        r1 = one.run(prompts, completions, answers)
    rn = math_pool.run(prompts, completions, answers)
    r0 = RewardExecutor(MathReward(), workers=0).run(prompts, completions, answers)  # one call in this process
    assert r1.rewards == rn.rewards == r0.rewards
    assert 0.0 < sum(r0.rewards) < N
    assert r1.timeouts == rn.timeouts == []


def test_raising_reward_names_the_sample(failing_pool):
    completions = ["ok"] * 20
    completions[7] = f"bad {RAISE}"
    with pytest.raises(RewardError, match=r"FailingReward raised on sample 7: .*ValueError: cannot score") as info:
        failing_pool.run(["p"] * 20, completions, [None] * 20)
    assert info.value.index == 7 and "Traceback" in info.value.detail
    assert failing_pool.run(["p"] * 3, ["ok"] * 3, [None] * 3).rewards == [1.0] * 3  # the pool is still usable
    completions[7] = DIE
    with pytest.raises(RewardError, match=r"sample 7: .*worker process died \(exit code 3\)"):
        failing_pool.run(["p"] * 20, completions, [None] * 20)
    assert failing_pool.run(["p"] * 3, ["ok"] * 3, [None] * 3).rewards == [1.0] * 3


def test_on_error_score_counts_instead():
    completions = ["ok", RAISE, "ok", RAISE]
    with RewardExecutor(FailingReward(), workers=1, on_error="score", error_value=-2.0) as ex:
        result = ex.run(["p"] * 4, completions, [None] * 4)
    assert result.rewards == [1.0, -2.0, 1.0, -2.0] and result.errors == [1, 3]
    assert result.metrics()["reward/errors"] == 2.0 and "sample 1" in result.error_example
    in_process = RewardExecutor(FailingReward(), workers=0, on_error="score", error_value=-2.0)
    assert in_process.run(["p"] * 4, completions, [None] * 4) == result


@pytest.mark.parametrize("workers", [1, 0])
def test_a_wrong_return_value_stops_the_batch_whatever_on_error_says(workers: int):
    """``on_error="score"`` covers rewards that raise on a sample; a reward that returns something other than one
    number per sample is a bug in the reward, so the batch stops with an error that says what it returned, in a worker
    and in the main process alike (whose batch value :func:`check_rewards` validates). Control: a reward that raises is
    still scored ``error_value``."""
    kind = {1: RewardError, 0: ValueError}[workers]
    with RewardExecutor(scalar_reward, workers=workers, on_error="score") as ex:
        if workers:
            match = r"scalar_reward returned float 1\.0 for 1 sample, not a sequence on sample 0"
            with pytest.raises(kind, match=match):
                ex.run(["p"] * 3, ["a", "b", "c"], [None] * 3)
        else:
            with pytest.raises(kind, match="rewards must be a sequence of floats, got float"):
                check_rewards(ex.run(["p"] * 3, ["a", "b", "c"], [None] * 3).rewards, 3)
    with RewardExecutor(text_reward, workers=workers, on_error="score") as ex:
        match = "returned the string '1', not a number on sample 0" if workers else "sample 0 is the string '1'"
        with pytest.raises(kind, match=match):
            check_rewards(ex.run(["p"] * 2, ["a", "b"], [None] * 2).rewards, 2)
    with RewardExecutor(FailingReward(), workers=workers, on_error="score", error_value=-1.0) as ex:
        assert ex.run(["p"] * 2, ["ok", RAISE], [None] * 2).rewards == [1.0, -1.0]


def test_a_reward_without_the_three_arguments_is_refused_before_it_runs():
    """A reward that cannot take ``(prompts, completions, answers)`` is refused when it is resolved or given to an
    executor, instead of raising on every sample (which ``on_error="score"`` would count as errors)."""
    match = r"two_argument_reward must take \(prompts, completions, answers\), three lists"
    with pytest.raises(TypeError, match=match):
        resolve_reward(two_argument_reward)
    with pytest.raises(TypeError, match=match):
        resolve_reward("_reward_helpers:two_argument_reward")
    with pytest.raises(TypeError, match=match):
        RewardExecutor(two_argument_reward, workers=1, on_error="score")
    assert resolve_reward(count_reward) is count_reward  # control: three parameters


def test_unpicklable_closure_warns_and_runs_in_process():
    calls = []

    def closure(prompts, completions, answers):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    with pytest.warns(UserWarning, match=r"closure runs in the main process.*cannot be pickled"):
        ex = RewardExecutor(closure, workers=2)
    assert ex.in_process
    assert ex.run(["p"] * 3, ["a", "bb", "ccc"], [None] * 3).rewards == [1.0, 2.0, 3.0]
    assert calls == [3]  # one call on the whole batch, as without an executor


def test_reward_a_worker_cannot_load_falls_back_to_in_process():
    with RewardExecutor(UnloadableReward(), workers=1) as ex:
        assert not ex.in_process  # it pickles: the failure shows only in the worker
        with pytest.warns(UserWarning, match=r"could not load it \(RuntimeError: this reward cannot be loaded"):
            result = ex.submit(["p"] * 3, ["a", "bb", "ccc"], [None] * 3).result(timeout=60)
        assert result.rewards == [1.0, 2.0, 3.0] and ex.in_process
        assert ex.run(["p"], ["dddd"], [None]).rewards == [4.0]


SCRIPT = """import warnings

from rlexact.rewards import ArithmeticReward, RewardExecutor

def main():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RewardExecutor(ArithmeticReward(), workers=1) as ex:
            result = ex.run(["1+1="], ["2"], ["2"])
            print("in_process", ex.in_process, result.rewards)
    for w in caught:
        print("warning:", w.message)

{call}
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_main_script_without_the_guard_is_named(tmp_path, guarded: bool):
    """A worker first imports the main script: one that starts the executor outside ``if __name__ == "__main__":``
    stops every worker (Python's bootstrapping error), and the fallback's warning names the script and the guard.
    Control: the same script with the guard runs the reward in a worker, without a warning."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(call='if __name__ == "__main__":\n    main()' if guarded else "main()"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"in_process {not guarded} [1.0]" in lines
    warned = [line for line in lines if line.startswith("warning:")]
    if guarded:
        assert warned == []
    else:
        assert len(warned) == 1 and f"main script ({script})" in warned[0]
        assert 'outside `if __name__ == "__main__":`' in warned[0] and "importable module" not in warned[0]


def test_in_process_batch_error_names_the_sample():
    def picky(prompts, completions, answers):
        return [1.0 / (len(c) - 2) for c in completions]

    ex = RewardExecutor(picky, workers=0)
    with pytest.raises(RewardError, match=r"picky raised on sample 2: .*ZeroDivisionError"):
        ex.run(["p"] * 4, ["a", "bbb", "cc", "dddd"], [None] * 4)


def test_importable_function_runs_in_workers():
    with RewardExecutor(count_reward, workers=1) as ex:
        assert not ex.in_process
        assert ex.run(["p"] * 3, ["1", "121", "x"], [None] * 3).rewards == [1.0, 2.0, 0.0]


def test_reward_config_validation():
    for bad in ({"workers": -1}, {"workers": 1.5}, {"timeout_s": 0}, {"timeout_s": float("inf")}):
        with pytest.raises(ValueError, match="reward.workers|reward.timeout_s"):
            RewardConfig(**bad)
    with pytest.raises(ValueError, match="reward.on_error must be one of"):
        RewardConfig(on_error="ignore")
    with pytest.raises(ValueError, match="reward.timeout_value must be a finite number"):
        RewardConfig(timeout_value=float("nan"))
    with pytest.raises(TypeError, match="unknown RewardExecutor options"):
        RewardExecutor(count_reward, timeout=3)
    with pytest.raises(ValueError, match="same length"):
        RewardExecutor(count_reward, workers=0).run(["a"], ["b", "c"], ["d"])


@pytest.mark.parametrize(
    "expr",
    [r"9^{9^{9^{9}}}", r"2^{10^{8}}", "9**9**9", r"10^{10^{10}}", r"(10^{6})!", r"\binom{10^{9}}{5}", "{" * 70],
)
def test_explosion_guard_flags(expr):
    assert explosion_reason(expr) is not None


@pytest.mark.parametrize(
    "expr",
    [r"2^{1000000}", r"7^{7^{7}}", "100000!", r"\frac{1}{2}", r"e^{x^2}", r"\left(\frac{3}{4}\right)^{2}", "3!!"],
)
def test_explosion_guard_passes(expr):
    assert explosion_reason(expr) is None


def test_module_scores_through_the_executor(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from models import tiny_rl_config
    from rlexact import RLModule
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.rollout import Completion
    from rlexact.trainer import rewards as reward_stage

    tok = build_char_tokenizer()
    module = RLModule(
        model_config=tiny_rl_config(len(tok), 64),
        tokenizer=tok,
        reward="_reward_helpers:SleepyReward",
        reward_config={"workers": 2, "timeout_s": 1.0, "timeout_value": -1.0},
        rollout={"n": 2},
    )
    assert module.hparams["reward_config"]["timeout_s"] == 1.0 and not module.reward_executor.in_process
    module.reward_executor.run(["w"], ["w"], [None])  # start the workers outside the timed part
    texts = ["12", HANG, "345", "6"]
    comps = [
        Completion(tok(t)["input_ids"][:1], tok(t)["input_ids"], None, "stop", k, k // 2) for k, t in enumerate(texts)
    ]
    items = [{"prompt_text": "1+1=", "answer": "2"}, {"prompt_text": "2+2=", "answer": "4"}]
    t0 = time.monotonic()
    rewards = module.compute_rewards(items, comps, 2)
    assert time.monotonic() - t0 < 1.0 + SLACK_S
    assert rewards.tolist() == [2.0, -1.0, 3.0, 1.0]
    result = module.reward_result
    metrics = reward_stage.execution_metrics(result)
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/timeout_frac"] == 0.25
    assert metrics["reward/errors"] == 0.0
    logger = TensorBoardLogger(tmp_path)
    reward_stage.log_reward_examples([logger], result, step=3)
    logger.experiment.flush()
    events = b"".join(p.read_bytes() for p in tmp_path.rglob("events.out.tfevents.*"))
    assert b"hang forever" in events and b"reward/timeout_example" in events
    with pytest.raises(ValueError, match="unknown RewardConfig keys"):
        RLModule(model_config=tiny_rl_config(len(tok), 64), tokenizer=tok, reward_config={"timeout": 3})


def test_executor_copies_as_the_shared_executor():
    import copy
    import pickle

    ex = RewardExecutor(count_reward, workers=0)
    clone = copy.deepcopy(ex)
    assert clone is shared_executor(count_reward, workers=0) and clone is not ex
    assert pickle.loads(pickle.dumps(ex)) is clone
    assert clone.run(["p"], ["11"], [None]).rewards == [2.0]
