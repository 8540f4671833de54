"""Settings a user can get wrong, each refused with an error that names the problem and the fix (or, where rlexact
can run them exactly, run exactly): a float64 Trainer precision or default dtype, a ``rollout.max_new_tokens`` that
fills the model's context, and prompt data that is a folder without data files, a missing file or a file of another
type."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import pytest
import torch

from rlexact import RLModule, ops
from rlexact.config import RolloutConfig
from rlexact.data import PromptDataModule, load_prompt_rows
from rlexact.ops import cpu
from rlexact.trainer.data_checks import check_prompt_lengths
from rlexact.trainer.policy import check_precision
from rlexact.trainer.sampling import check_prompts
from test_module import Inspect, fit, length_reward

DEMO_DATA = "rlexact://demo/data/train.jsonl"


@pytest.fixture
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 for the test (what Lightning's ``64-true`` precision sets around each step),
    with the block-product probe's memo cleared so that it probes under it; both restored after."""
    saved = torch.get_default_dtype()
    cpu.check_block_product.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
        cpu.check_block_product.cache_clear()


def demo_fit(steps: int, callbacks: list | None = None, precision: str | int = "32-true", **rollout: int) -> RLModule:
    """``steps`` training steps of the packaged demo checkpoint on four packaged prompts; returns the module."""
    module = RLModule(model_path="demo", reward=length_reward, reward_config={"workers": 0},  # in this process
                      rollout={"n": 2, "max_new_tokens": 4, **rollout})  # fmt: skip
    fit(
        module,
        steps,
        callbacks,
        PromptDataModule(DEMO_DATA, tokenizer="demo", batch_size=2, limit=4),
        precision=precision,
    )
    return module


def trainer_with(precision: str | int) -> L.Trainer:
    """A CPU Trainer with ``precision`` as given (Lightning reports it normalized, e.g. ``64`` as ``"64-true"``)."""
    return L.Trainer(precision=precision, accelerator="cpu", logger=False, enable_progress_bar=False)


# ---------------------------------------------------------------------------------------------------------------------
# float64: the Trainer precision, torch's default dtype, the ops
# ---------------------------------------------------------------------------------------------------------------------


def test_block_product_probe_multiplies_fp32_under_a_float64_default(float64_default, monkeypatch) -> None:
    """The row-invariance probe builds its operands in fp32, the dtype the CPU matmul multiplies in, whatever the
    default dtype: under float64 it used to probe MKL's float64 product and blame the host's BLAS."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    plain = cpu._block_product

    def recording(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append((x.dtype, w.dtype))
        return plain(x, w)

    monkeypatch.setattr(cpu, "_block_product", recording)
    cpu.check_block_product(128, 128, torch.get_num_threads())  # the shape of the review's repro
    assert seen and set(seen) == {(torch.float32, torch.float32)}
    x, w = torch.randn(5, 128), torch.randn(128, 128)
    assert x.dtype == torch.float64
    assert torch.equal(ops.matmul(x, w), ops.matmul(x.float(), w.float()).double())


def test_float64_inputs_compute_in_fp32() -> None:
    """The documented float64 contract of the CPU twins: fp32 computation (the fp32 input's bits, widened), so the
    rows stay as invariant as fp32's; no float64 precision."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 40, generator=g, dtype=torch.float64), torch.randn(24, 40, generator=g, dtype=torch.float64)
    out = ops.matmul(x, w)
    assert out.dtype == torch.float64 and torch.equal(out, ops.matmul(x.float(), w.float()).double())
    assert torch.equal(ops.matmul(x[3:4], w), out[3:4])
    assert not torch.equal(out, x @ w.T)  # negative control: not the float64 product
    nw = torch.rand(40, generator=g, dtype=torch.float64) + 0.5
    assert torch.equal(ops.rms_norm(x[:9], nw, 1e-6), ops.rms_norm(x, nw, 1e-6)[:9])


@pytest.mark.parametrize("precision", ["64-true", "64", 64])
def test_float64_trainer_precision_is_refused_by_name(precision: str | int) -> None:
    with pytest.raises(ValueError) as info:
        check_precision(trainer_with(precision))
    message = str(info.value)
    assert "Trainer(precision='64-true') converts the model to float64" in message
    assert "'float32', 'bfloat16', 'float16'" in message and "RLModule(dtype=...)" in message
    assert "'32-true'" in message and "not row-invariant" not in message


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-true"])
def test_true_precisions_rlexact_supports_are_accepted(precision: str) -> None:
    check_precision(trainer_with(precision))
    check_precision(
        trainer_with(precision), {"32-true": "bfloat16", "bf16-true": "bfloat16", "16-true": "float16"}[precision]
    )


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", "float32"), ("16-true", "bfloat16")])
def test_half_precision_against_the_modules_dtype_is_refused(precision: str, dtype: str) -> None:
    """The Trainer would convert the model away from the dtype the module was asked for, without a word."""
    with pytest.raises(
        ValueError, match=rf"precision='{precision}'\) converts the model to .* RLModule\(dtype='{dtype}'\)"
    ):
        check_precision(trainer_with(precision), dtype)


def test_mixed_precision_keeps_its_autocast_error() -> None:
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'\) runs the step under autocast"):
        check_precision(trainer_with("bf16-mixed"))


def test_fit_at_64_true_stops_at_fit_start_not_in_the_kernels() -> None:
    """The review's repro: ``Trainer(precision="64-true")`` reached the first rollout and failed there with a BLAS
    diagnosis; it stops before any step with the precision error."""
    with pytest.raises(ValueError, match=r"precision='64-true'\) converts the model to float64"):
        demo_fit(1, precision="64-true")


def test_demo_fit_under_a_float64_default_dtype_is_exact(float64_default) -> None:
    """``torch.set_default_dtype(torch.float64)`` before building ``RLModule(model_path="demo")``: the checkpoint
    loads in its own dtype (float32) and training runs exactly (rollout log-probs equal the trainer's)."""
    check = Inspect()
    module = demo_fit(2, [check])
    assert next(module.model.parameters()).dtype == torch.float32
    assert check.trainer_eq_rollout == check.first_ratio_one_all == [True, True]


# ---------------------------------------------------------------------------------------------------------------------
# rollout.max_new_tokens against the model's context
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [64, 100])
def test_max_new_tokens_filling_the_context_names_the_setting(max_new_tokens: int) -> None:
    with pytest.raises(ValueError) as info:
        check_prompt_lengths(longest=6, row=3, max_context=64, max_new_tokens=max_new_tokens)
    message = str(info.value)
    assert message.startswith(
        f"rollout.max_new_tokens={max_new_tokens} must be below the model's context of 64 tokens: a rollout needs at "
        "least one prompt token; lower rollout.max_new_tokens to at most 58, which leaves room for the longest "
        "prompt (dataset row 3, 6 tokens)"
    )
    assert "max_prompt_length" not in message


def test_max_new_tokens_error_without_a_bound_when_the_prompt_fills_the_context_too() -> None:
    with pytest.raises(ValueError, match=r"must be below the model's context of 64 tokens.*max_new_tokens$"):
        check_prompt_lengths(longest=70, row=0, max_context=64, max_new_tokens=64)


def test_long_prompt_keeps_the_max_prompt_length_advice() -> None:
    with pytest.raises(ValueError, match=r"at most 4 tokens; set PromptDataModule\(max_prompt_length=4\)"):
        check_prompt_lengths(longest=6, row=0, max_context=64, max_new_tokens=60)
    check_prompt_lengths(longest=6, row=0, max_context=64, max_new_tokens=58)  # control: it fits exactly


def test_fit_with_max_new_tokens_past_the_demo_context() -> None:
    """The caller (``RLModule.on_fit_start``) passes the model's context: the demo checkpoint's 64 positions."""
    with pytest.raises(ValueError, match=r"max_new_tokens=100 must be below the model's context of 64 tokens"):
        demo_fit(1, max_new_tokens=100)


def test_batch_check_with_max_new_tokens_past_the_context_names_the_setting() -> None:
    """Data from any loader (not a PromptDataModule) is checked per batch (``sampling.check_prompts``): the same error,
    and the ordinary advice where a prompt merely runs long."""
    items = [{"prompt_ids": [1] * 6, "index": 3}]
    with pytest.raises(ValueError, match=r"max_new_tokens=100 must be below the model's context of 64 tokens"):
        check_prompts(items, RolloutConfig(max_new_tokens=100), max_positions=64)
    with pytest.raises(ValueError, match=r"at most 4 tokens \(filter long prompts"):
        check_prompts(items, RolloutConfig(max_new_tokens=60), max_positions=64)
    assert check_prompts(items, RolloutConfig(max_new_tokens=58), max_positions=64) == [[1] * 6]  # control: fits


# ---------------------------------------------------------------------------------------------------------------------
# prompt data sources
# ---------------------------------------------------------------------------------------------------------------------

ACCEPTED = r"prompt data is a \.csv, \.json, \.jsonl or \.parquet file, a folder of such files.*Hub dataset name"


def write_prompts(path, n: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(n)))


def test_folder_without_data_files(tmp_path, monkeypatch) -> None:
    """The review's ``PromptDataModule(path=".")``: a folder of code and notes, no data files."""
    (tmp_path / "train.py").write_text("print()\n")
    (tmp_path / "notes.txt").write_text("prompts go here\n")
    write_prompts(tmp_path / ".hidden" / "train.jsonl")  # hidden, as datasets leaves it aside
    monkeypatch.chdir(tmp_path)
    where = f"prompt data folder '{tmp_path}' is neither a datasets save_to_disk folder nor holds"
    with pytest.raises(ValueError, match=f"{where} .csv, .json, .jsonl or .parquet files; {ACCEPTED}"):
        PromptDataModule(".", tokenizer="demo").setup("fit")


def test_folder_datasets_cannot_read(tmp_path) -> None:
    write_prompts(tmp_path / "test.jsonl")
    with pytest.raises(
        ValueError, match=rf"did not load as one dataset of its data files \(datasets: .*train.*{ACCEPTED}"
    ):
        load_prompt_rows(tmp_path, split="train")
    assert len(load_prompt_rows(tmp_path, split="test")) == 2  # control: the split that is there


def test_folder_of_data_files_and_packaged_sources_still_load(tmp_path) -> None:
    write_prompts(tmp_path / "data" / "train.jsonl", 3)
    assert len(load_prompt_rows(tmp_path / "data")) == 3
    data = PromptDataModule(DEMO_DATA, tokenizer="demo", limit=4)
    data.setup("fit")
    assert len(data.train_dataset) == 4


def test_file_of_another_type(tmp_path) -> None:
    path = tmp_path / "prompts.tsv"
    path.write_text("prompt\tanswer\n1+1=\t2\n")
    with pytest.raises(ValueError, match=f"prompt data file '{path}' is not of a type rlexact reads; {ACCEPTED}"):
        PromptDataModule(str(path), tokenizer="demo").setup("fit")


def test_missing_file_neither_here_nor_on_the_hub(tmp_path, monkeypatch) -> None:
    """A name that could be a Hub dataset goes to the Hub; when that fails too, the error says where the local lookup
    looked, why the Hub did not answer, what is accepted and how to mark a local path. No network: the Hub's answer
    is datasets' own not-found error."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def hub(path: str, *args, **kwargs):
        raise DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        PromptDataModule("prompts.txt", tokenizer="demo").setup("fit")
    message = str(info.value)
    assert message.startswith(
        f"prompt data 'prompts.txt' is no file or folder here (looked for '{tmp_path / 'prompts.txt'}') and did not "
        "load as a Hub dataset (Dataset 'prompts.txt' doesn't exist on the Hub or cannot be accessed.); prompt data is"
    )
    assert message.endswith("(start a local path with ./ to skip the Hub lookup)")
    with pytest.raises(FileNotFoundError, match="'prompts.jsonl' not found .*never looked up on the Hub"):
        PromptDataModule("prompts.jsonl", tokenizer="demo")  # control: a data file's name is never a Hub lookup


def test_drop_last_with_fewer_prompts_than_a_batch_is_refused() -> None:
    """Lightning would end such a fit at once, with status 0 and nothing trained."""
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    data = PromptDataModule(rows, tokenizer="demo", batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"2 prompts per rank .* fewer than batch_size=4, and drop_last=True"):
        data.train_dataloader()
    assert len(PromptDataModule(rows, tokenizer="demo", batch_size=4).train_dataloader()) == 1  # control
    assert len(PromptDataModule(rows, tokenizer="demo", batch_size=2, drop_last=True).train_dataloader()) == 1


def test_float64_model_is_refused_and_dtype_converts_it() -> None:
    """A float64 model would run at float32 precision without a word; ``dtype=`` converts it (control)."""
    from transformers import AutoModelForCausalLM

    from rlexact.demo.run import checkpoint_path

    with pytest.raises(ValueError, match=r"the model has torch.float64 parameters.*RLModule\(dtype=\.\.\.\)"):
        RLModule(model=AutoModelForCausalLM.from_pretrained(checkpoint_path()).double(), tokenizer="demo")
    module = RLModule(model=AutoModelForCausalLM.from_pretrained(checkpoint_path()).double(), tokenizer="demo",
                      dtype="float32")  # fmt: skip
    assert module.model.dtype == torch.float32
