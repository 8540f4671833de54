"""Demo tokenizer and task, reward functions, reward validation and the prompt data module (CPU, no network)."""

from __future__ import annotations

import json
import math
import pickle
import threading
import warnings

import pytest
import torch

from rlexact import RLModule
from rlexact.char_tokenizer import EOS_ID, PAD_ID, VOCAB, build_char_tokenizer
from rlexact.data import (
    DEMO_TOKENIZER,
    PromptDataModule,
    ResumableSampler,
    encode_prompts,
    load_prompt_rows,
    load_tokenizer,
)
from rlexact.demo.task import ArithmeticTask, make_dataset, read_jsonl, write_jsonl
from rlexact.rewards import (
    ArithmeticReward,
    ExactMatchReward,
    MathReward,
    RewardFn,
    check_rewards,
    extract_final_answer,
    resolve_reward,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_vocab_and_ids(tok):
    assert len(tok) == len(VOCAB) < 64
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_ID == 3
    assert tok.pad_token == "<pad>" and tok.pad_token_id == PAD_ID == 0
    assert tok.bos_token is None
    ids = tok("12+7=")["input_ids"]
    assert ids == [VOCAB[c] for c in "12+7="]  # one id per character, no BOS
    text = "what is 3*4? a: 12, ok.\nx - y = 0"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode(tok("19<|im_end|>")["input_ids"]) == "19<|im_end|>"
    assert tok("19<|im_end|>")["input_ids"][-1] == EOS_ID
    assert tok.decode([VOCAB["1"], VOCAB["9"], EOS_ID], skip_special_tokens=True) == "19"
    assert tok("A")["input_ids"] == [VOCAB["a"]]  # lower-cased
    assert tok("#")["input_ids"] == [tok.unk_token_id]


def test_tokenizer_chat_template(tok):
    s = tok.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False, add_generation_prompt=True)
    assert s == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    s2 = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=False)
    assert s2 == "<|im_start|>user\n1+1=<|im_end|>\n"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and EOS_ID in ids
    assert tok.decode(ids) == s


def test_tokenizer_round_trip(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok2.get_vocab() == tok.get_vocab()
    assert (tok2.eos_token_id, tok2.pad_token_id) == (EOS_ID, PAD_ID)
    assert tok2.chat_template == tok.chat_template
    text = "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n19<|im_end|>"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.decode(tok2(text)["input_ids"]) == text


# --------------------------------------------------------------------------- task


def test_task_deterministic_and_correct():
    a = make_dataset(50, seed=3)
    assert a == make_dataset(50, seed=3)
    assert a[:20] == make_dataset(20, seed=3)  # prefix-stable
    assert a != make_dataset(50, seed=4)
    for row in a:
        assert set(row) == {"prompt", "answer"}
        lhs = row["prompt"]
        assert lhs.endswith("=") and "+" in lhs
        x, y = lhs[:-1].split("+")
        assert 0 <= int(x) <= 99 and 0 <= int(y) <= 99
        assert int(row["answer"]) == int(x) + int(y)
    task = ArithmeticTask(seed=1, max_operand=9, ops=("+", "-", "*"))
    rows = task.generate(200)
    assert rows == ArithmeticTask(seed=1, max_operand=9, ops=("+", "-", "*")).generate(200)
    assert {r["prompt"][1] for r in rows} == {"+", "-", "*"}
    for r in rows:
        assert int(r["answer"]) >= 0  # no negatives by default
        assert str(eval(r["prompt"][:-1])) == r["answer"]
    with pytest.raises(ValueError):
        ArithmeticTask(ops=("/",))


def test_write_read_jsonl(tmp_path):
    rows = make_dataset(5, seed=0)
    p = write_jsonl(tmp_path / "sub" / "d.jsonl", rows)
    assert read_jsonl(p) == rows


# --------------------------------------------------------------------------- rewards


def test_math_reward():
    r = MathReward()
    assert isinstance(r, RewardFn)
    completions = [
        "so the answer is \\boxed{\\frac{1}{2}}.",
        "first 3 then 5, finally 42",
        "\\boxed{41} no wait \\boxed{42}",
        "\\boxed{41} no wait 42",  # boxed wins over a later plain number
        "there are 1,000 apples",
        "no number here",
        "\\boxed{(x+1)^2}",
        "x = -7.",
        "\\boxed{\\text{{unbalanced}",
        "",
    ]
    answers = ["0.5", "42", "42", "42", "1000", "1", "x^2+2x+1", "-7", "3", "1"]
    got = r([""] * len(answers), completions, answers)
    assert got == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert r(["q"], ["\\boxed{2}"], [None]) == [0.0]
    assert r(["q"], ["\\boxed{\\frac{1}{2}}"], ["the result is $\\boxed{0.5}$"]) == [1.0]
    assert extract_final_answer("a \\boxed{\\frac{a}{b}} b 7") == "\\frac{a}{b}"
    assert extract_final_answer("1,234.5 and 3 / 4") == "3/4"
    with pytest.raises(ValueError, match="same length"):
        r(["a"], ["b", "c"], ["d"])


def test_math_reward_off_main_thread():
    out = {}

    def work():
        out["plain"] = MathReward()(["", ""], ["\\boxed{2/4}", "12"], ["\\frac{1}{2}", "13"])
        out["timeout"] = MathReward(timeout_seconds=2)(["", ""], ["\\boxed{2/4}", "12"], ["\\frac{1}{2}", "13"])

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert out == {"plain": [1.0, 0.0], "timeout": [1.0, 0.0]}


def test_exact_match_reward():
    r = ExactMatchReward()
    got = r(["p"] * 6, ["19", " 19 \nmore", "19<|im_end|>junk", "19.", "", "abc"], ["19", "19", "19", "19", "19", None])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert ExactMatchReward(case_sensitive=False)(["p"], ["Yes"], ["yes"]) == [1.0]


def test_arithmetic_reward_partial_credit():
    strict = ArithmeticReward()
    partial = ArithmeticReward(partial_credit=True)
    comps = ["19", "19<|im_end|>", "019", "18", "29", "9", "191", "x", "", "1 9", "-19"]
    assert strict(["12+7="] * len(comps), comps, ["19"] * len(comps)) == [1.0, 1.0, 1.0] + [0.0] * 8
    got = partial(["12+7="] * len(comps), comps, ["19"] * len(comps))
    assert got == [1.0, 1.0, 1.0, 0.6, 0.6, 0.4, 0.1, 0.0, 0.0, 0.0, 0.4]
    assert got == partial(["12+7="] * len(comps), comps, ["19"] * len(comps))  # deterministic
    # the exact answer is always strictly best
    for gold in (0, 7, 10, 99, 131, 198):
        for pred in range(0, 250):
            if pred != gold:
                s = partial([""], [str(pred)], [str(gold)])[0]
                assert 0.1 <= s < 0.9
    assert partial([""], ["abc"], ["abc"]) == [1.0]  # non-integer ground truth: exact match


def test_resolve_reward():
    assert isinstance(resolve_reward("math"), MathReward)
    assert isinstance(resolve_reward("exact_match"), ExactMatchReward)
    assert isinstance(resolve_reward("Exact-Match"), ExactMatchReward)
    a = resolve_reward("arithmetic", partial_credit=True)
    assert isinstance(a, ArithmeticReward) and a.partial_credit
    assert isinstance(resolve_reward("rlexact.rewards.synthetic:ArithmeticReward"), ArithmeticReward)

    def fn(prompts, completions, answers):
        return [0.0] * len(prompts)

    assert resolve_reward(fn) is fn
    assert isinstance(resolve_reward(ArithmeticReward), ArithmeticReward)
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")
    with pytest.raises(TypeError):
        resolve_reward(3)


def test_check_rewards():
    t = check_rewards([1, 0.5, 0.0], 3)
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 0.5, 0.0]
    assert check_rewards(torch.tensor([1.0, 2.0], dtype=torch.float64), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="got 2 rewards for 3 samples"):
        check_rewards([1.0, 0.0], 3)
    with pytest.raises(ValueError, match="sample 1"):
        check_rewards([1.0, math.nan, math.inf], 3)
    with pytest.raises(ValueError, match="sample 2"):
        check_rewards(torch.tensor([0.0, 1.0, -math.inf]), 3)
    with pytest.raises(ValueError, match="sample 0"):
        check_rewards(["x"], 1)
    with pytest.raises(ValueError, match="sample 0"):
        check_rewards([1e300], 1)  # overflows float32


# --------------------------------------------------------------------------- data


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_encode_prompts(tok):
    raw = encode_prompts(tok, ["1+2=", "10+20="], use_chat_template=False)
    assert raw == [tok("1+2=")["input_ids"], tok("10+20=")["input_ids"]]
    chat = encode_prompts(tok, ["1+2="], use_chat_template=True)
    assert tok.decode(chat[0]) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    msgs = [[{"role": "user", "content": "1+2="}]]
    assert encode_prompts(tok, msgs, use_chat_template=True) == chat
    assert encode_prompts(tok, [], use_chat_template=False) == []


def test_datamodule_jsonl(tmp_path, tok):
    rows = make_dataset(21, seed=0)
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    dm = PromptDataModule(path, tokenizer="demo-char", batch_size=4, use_chat_template=False, seed=5)
    dm.setup("fit")
    assert len(dm.train_dataset) == 21
    batches = list(dm.train_dataloader())
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 1]
    items = [it for b in batches for it in b]
    assert sorted(it["index"] for it in items) == list(range(21))
    for it in items:
        assert set(it) == {"prompt_ids", "prompt_text", "answer", "index", "epoch"} and it["epoch"] == 0
        assert it["prompt_text"] == rows[it["index"]]["prompt"]
        assert it["answer"] == rows[it["index"]]["answer"]
        assert it["prompt_ids"] == tok(it["prompt_text"])["input_ids"]
        assert all(isinstance(x, int) for x in it["prompt_ids"])
    # deterministic from seed, new order per epoch, same order after "restart"
    order = lambda d: [it["index"] for b in d.train_dataloader() for it in b]  # noqa: E731
    dm2 = PromptDataModule(path, tokenizer=tok, batch_size=4, use_chat_template=False, seed=5)
    dm2.setup("fit")
    assert order(dm2) == order(dm) == [it["index"] for it in items]
    dl = dm2.train_dataloader()
    dl.sampler.set_epoch(1)
    epoch1 = [it["index"] for b in dl for it in b]
    assert epoch1 != order(dm) and sorted(epoch1) == list(range(21))
    dm3 = PromptDataModule(path, tokenizer=tok, batch_size=4, use_chat_template=False, seed=6)
    assert order(dm3) != order(dm)
    assert order(PromptDataModule(path, tokenizer=tok, batch_size=4, shuffle=False)) == list(range(21))
    # the chat template is off unless asked for, although the demo tokenizer has one
    dm4 = PromptDataModule(path, tokenizer=tok, batch_size=2, limit=3)
    dm4.setup("fit")
    assert not dm4.chat_template_enabled and len(dm4.train_dataset) == 3
    assert tok.decode(dm4.train_dataset[0]["prompt_ids"]) == rows[0]["prompt"]
    dm5 = PromptDataModule(path, tokenizer=tok, batch_size=2, limit=3, use_chat_template=True)
    dm5.setup("fit")
    assert tok.decode(dm5.train_dataset[0]["prompt_ids"]).startswith("<|im_start|>user\n")
    assert pickle.loads(pickle.dumps(dm5)).train_dataset[0] == dm5.train_dataset[0]


def test_datamodule_parquet_val_and_custom_keys(tmp_path, tok):
    import datasets

    rows = [{"question": f"{i}+1=", "solution": i + 1} for i in range(10)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    val = write_jsonl(tmp_path / "val.jsonl", [{"question": "2+2=", "solution": 4}])
    dm = PromptDataModule(
        str(tmp_path / "d.parquet"),
        tokenizer=tok,
        prompt_key="question",
        answer_key="solution",
        batch_size=3,
        use_chat_template=False,
        val_path=val,
    )
    dm.setup("fit")
    items = [it for b in dm.train_dataloader() for it in b]
    assert {it["answer"] for it in items} == {str(i + 1) for i in range(10)}
    val_items = [it for b in dm.val_dataloader() for it in b]
    assert val_items == [{"prompt_ids": tok("2+2=")["input_ids"], "prompt_text": "2+2=", "answer": "4", "index": 0}]


def test_datamodule_directories(tmp_path, tok):
    import datasets

    rows = make_dataset(6, seed=0)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    dm = PromptDataModule(str(tmp_path / "saved"), tokenizer=tok, use_chat_template=False, shuffle=False)
    dm.setup("fit")
    assert [it["prompt_text"] for b in dm.train_dataloader() for it in b] == [r["prompt"] for r in rows]
    with pytest.raises(ValueError, match="available splits"):
        PromptDataModule(str(tmp_path / "saved"), tokenizer=tok, split="test").setup("fit")
    write_jsonl(tmp_path / "folder" / "train.jsonl", rows)
    dm = PromptDataModule(str(tmp_path / "folder"), tokenizer=tok, use_chat_template=False)
    dm.setup("fit")
    assert len(dm.train_dataset) == 6


def test_datamodule_from_saved_tokenizer_dir(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tok")
    path = write_jsonl(tmp_path / "d.jsonl", make_dataset(3, seed=0))
    dm = PromptDataModule(path, tokenizer=str(tmp_path / "tok"), batch_size=2, use_chat_template=False)
    dm.setup("fit")
    assert dm.train_dataset[0]["prompt_ids"] == tok(dm.train_dataset[0]["prompt_text"])["input_ids"]


def test_datamodule_errors(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        PromptDataModule(str(empty), tokenizer=tok).setup("fit")
    with pytest.raises(ValueError, match="is empty"):
        PromptDataModule([], tokenizer=tok).setup("fit")

    path = tmp_path / "d.jsonl"
    _write_rows(path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123456+654321=", "answer": "777777"}])
    with pytest.raises(ValueError, match=r"prompt_key 'question'.*\['prompt', 'answer'\]"):
        PromptDataModule(str(path), tokenizer=tok, prompt_key="question").setup("fit")
    with pytest.raises(TypeError, match="tokenizer"):
        PromptDataModule(str(path))  # the tokenizer is required (no silent demo-tokenizer default)
    with pytest.raises(ValueError, match="a tokenizer is required"):
        PromptDataModule(str(path), tokenizer=None)
    with pytest.raises(ValueError, match="use_chat_template must be True or False"):
        PromptDataModule(str(path), tokenizer=tok, use_chat_template=None)
    with pytest.raises(ValueError, match="overlong must be 'filter' or 'raise'"):
        PromptDataModule(str(path), tokenizer=tok, overlong="truncate")


def test_missing_local_data_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    import datasets

    def hub(path, *args, **kwargs):
        raise LookupError(f"hub lookup of {path!r}")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.chdir(tmp_path)
    for path in ("data/train.jsonl", str(tmp_path / "missing.parquet"), "./prompts", "~/no/train.csv"):
        with pytest.raises(FileNotFoundError, match="not found .*never looked up on the Hub"):
            load_prompt_rows(path)
    with pytest.raises(LookupError, match="hub lookup of 'owner/name'"):  # a Hub name still goes to the Hub
        load_prompt_rows("owner/name")
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_rows(tmp_path / "home.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(LookupError, match="hub lookup of 'json'"):  # found under ~, read as a local file
        load_prompt_rows("~/home.jsonl")
    with pytest.raises(FileNotFoundError, match="tokenizer '/nope/tok' does not exist"):
        load_tokenizer("/nope/tok")
    with pytest.raises(FileNotFoundError, match="PromptDataModule val_path 'eval.jsonl' not found"):  # at init
        PromptDataModule(str(tmp_path / "home.jsonl"), tokenizer=DEMO_TOKENIZER, val_path="eval.jsonl")
    with pytest.raises(FileNotFoundError, match="tokenizer './tok' does not exist"):  # at init, not on first use
        PromptDataModule(str(tmp_path / "home.jsonl"), tokenizer="./tok")
    from rlexact import RLModule

    with pytest.raises(FileNotFoundError, match="tokenizer '~/tok' does not exist"):
        RLModule(model_config={"model_type": "qwen3"}, tokenizer="~/tok")


def test_a_name_neither_here_nor_on_the_hub_says_how_to_mark_a_local_path(tmp_path, monkeypatch):
    """A relative name may be a Hub repository, so it goes to the Hub; when that fails and no such folder exists, the
    error names the setting, the folder the local lookup started from and the ``./`` prefix. A folder that exists
    but does not load keeps the loader's own error (control)."""
    import transformers

    from rlexact.trainer.policy import build_model

    def hub(path, *args, **kwargs):
        raise OSError(f"We couldn't connect to the Hub for {path}\nsecond line")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    monkeypatch.chdir(tmp_path)
    local = f"is not a folder here \\(looked from {tmp_path}\\) and did not load as a Hub repository"
    reason = r"\(We couldn't connect to the Hub for ckpt/Qwen3-1.7B\)\. .*start it with ./$"
    with pytest.raises(FileNotFoundError, match=f"model_path 'ckpt/Qwen3-1.7B' {local} {reason}"):
        build_model("ckpt/Qwen3-1.7B", None, None, 0)
    with pytest.raises(FileNotFoundError, match=f"tokenizer 'ckpt/tok' {local}"):
        load_tokenizer("ckpt/tok")
    with pytest.raises(FileNotFoundError, match=rf"^model_path \(the default tokenizer\) 'ckpt/Q' {local}"):
        _ = RLModule("ckpt/Q").tokenizer  # the tokenizer the user never named comes from model_path
    with pytest.raises(FileNotFoundError, match=f"^tokenizer 'ckpt/tok' {local}"):
        _ = RLModule("ckpt/Q", tokenizer="ckpt/tok").tokenizer
    (tmp_path / "ckpt" / "Qwen3-1.7B").mkdir(parents=True)
    with pytest.raises(OSError, match="second line") as info:
        build_model("ckpt/Qwen3-1.7B", None, None, 0)
    assert not isinstance(info.value, FileNotFoundError)


def test_max_prompt_length_filters_or_raises(tmp_path, tok, caplog):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123456+654321=", "answer": "777777"}, {"prompt": "2+2="}]
    _write_rows(path, rows)
    dm = PromptDataModule(str(path), tokenizer=tok, max_prompt_length=10)
    with caplog.at_level("INFO"):
        dm.setup("fit")
    assert [it["index"] for it in dm.train_dataset] == [0, 2]  # the row index survives the filter
    assert dm.num_filtered == {repr(str(path)): 1}
    assert "filtered 1 of 3 prompts" in caplog.text and "max_prompt_length=10" in caplog.text
    assert dm.train_dataset.longest_prompt == (4, 0) and dm.train_dataset.max_token_id == max(tok('2+2=')['input_ids'])
    with pytest.raises(ValueError, match=r"row 1 .*14 tokens > max_prompt_length=10 \(overlong='raise'"):
        PromptDataModule(str(path), tokenizer=tok, max_prompt_length=10, overlong="raise").setup("fit")
    with pytest.raises(ValueError, match="every prompt .* longer than max_prompt_length=2"):
        PromptDataModule(str(path), tokenizer=tok, max_prompt_length=2).setup("fit")
    PromptDataModule(str(path), tokenizer=tok, max_prompt_length=14, overlong="raise").setup("fit")


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ('{"prompt": "1+1="}\n{"prompt": "2+2=", }\n', 2, "not valid JSON"),
        ('{"prompt": "1+1="}\n\n{"prompt": "2+2="}\n["3+3="]\n', 4, "expected a JSON object per line, got list"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, tok, text, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad.jsonl, line {line}: {problem}"):
        PromptDataModule(str(path), tokenizer=tok).setup("fit")


def test_resumable_sampler():
    s = ResumableSampler(10, seed=1)
    a = list(s)
    assert a == list(ResumableSampler(10, seed=1)) and sorted(a) == list(range(10))
    assert a == torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    s.set_epoch(3)
    assert list(s) == list(ResumableSampler(10, seed=4))
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    # ranks take interleaved positions of the one global order (padded by wrapping around)
    shards = [list(ResumableSampler(5, seed=1, num_replicas=2, rank=r)) for r in (0, 1)]
    glob = list(ResumableSampler(5, seed=1))
    assert shards == [glob[0::2], glob[1::2] + glob[:1]]
    s = ResumableSampler(10, seed=1)
    s.resume(0, 4)
    assert list(s) == a[4:] and list(s) == a  # the resume applies to one iteration


def test_a_missing_answer_column_is_named(tok):
    """Rows without the answer column: a named ``answer_key`` raises with the columns; the default ``"answer"``
    warns (a ground-truth reward would score 0) and gives None answers; ``answer_key=None`` says there are none, and
    a present column gives its values (controls)."""
    rows = [{"question": f"{i}+1=", "solution": str(i + 1)} for i in range(3)]
    with pytest.raises(ValueError, match=r"answer_key 'gold' not in dataset .*columns: \['question', 'solution'\]"):
        PromptDataModule(rows, tokenizer=tok, prompt_key="question", answer_key="gold").setup("fit")
    dm = PromptDataModule(rows, tokenizer=tok, prompt_key="question")
    with pytest.warns(UserWarning, match="answer_key 'answer' not in dataset .*scores 0: set answer_key to the column"):
        dm.setup("fit")
    assert [item["answer"] for item in dm.train_dataset] == [None] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for key, answers in ((None, [None] * 3), ("solution", ["1", "2", "3"])):
            dm = PromptDataModule(rows, tokenizer=tok, prompt_key="question", answer_key=key)
            dm.setup("fit")
            assert [item["answer"] for item in dm.train_dataset] == answers


def test_resumable_loader_state(tmp_path, tok):
    dm = PromptDataModule([{"prompt": f"{i}+1="} for i in range(7)], tokenizer=tok, batch_size=3, seed=2)
    dm.setup("fit")
    dl = dm.train_dataloader()
    full = [[it["index"] for it in b] for b in dl]
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    assert state == {
        "epoch": 0, "batches": 1, "batch_size": 3, "num_items": 7, "seed": 2, "shuffle": True, "num_replicas": 1
    }  # fmt: skip
    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    assert [[it["index"] for it in b] for b in fresh] == full[1:]
    assert fresh.state_dict()["batches"] == 3
    done = dm.train_dataloader()
    done.load_state_dict({**state, "batches": 3})  # a complete epoch: continue with the next one
    done.sampler.set_epoch(1)
    epoch1 = [[it["index"] for it in b] for b in done]
    dl.sampler.set_epoch(1)
    assert epoch1 == [[it["index"] for it in b] for b in dl] != full


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_items": 8}, "num_items=8, this run has num_items=7; resume with the same prompts"),
        ({"seed": 3}, "seed=3, this run has seed=2; resume with the same data.seed"),
        ({"shuffle": False}, "shuffle=False, this run has shuffle=True"),
        ({"batch_size": 2}, "written with batch_size=2 on 1 data-parallel rank.*same data.batch_size"),
    ],
)
def test_resumable_loader_rejects_other_data(tok, change, message):
    dm = PromptDataModule([{"prompt": f"{i}+1="} for i in range(7)], tokenizer=tok, batch_size=3, seed=2)
    state = {"epoch": 0, "batches": 1, "batch_size": 3, "num_items": 7, "seed": 2, "shuffle": True, "num_replicas": 1}
    with pytest.raises(ValueError, match=message):
        dm.train_dataloader().load_state_dict({**state, **change})


# --------------------------------------------------------------------------- checks against the policy


def test_validate_without_val_path_names_the_setting(tok):
    message = r"validation needs evaluation prompts: set PromptDataModule\(val_path=\.\.\.\)"
    with pytest.raises(ValueError, match=message):
        PromptDataModule([{"prompt": "1+1="}], tokenizer=tok).setup("validate")


def test_packaged_names_resolve_and_unknown_ones_error():
    from rlexact.resources import checkpoint_path, config_path, resolve

    assert resolve("demo") == resolve("rlexact://demo") == checkpoint_path()
    assert resolve("rlexact://demo/data/train.jsonl").endswith("demo/assets/data/train.jsonl")
    assert config_path("demo") == config_path("demo.yaml") == resolve("rlexact://configs/demo.yaml")
    assert config_path("no_such_recipe") is None and resolve("/some/path") == "/some/path"
    with pytest.raises(FileNotFoundError, match="unknown packaged name 'rlexact://models/x'"):
        resolve("rlexact://models/x")
    with pytest.raises(FileNotFoundError, match="no packaged recipe 'rlexact://configs/nope'"):
        resolve("rlexact://configs/nope")


def test_tokenizer_agreement(tok, tmp_path):
    from transformers import AutoTokenizer

    from rlexact.trainer.data_checks import same_tokenizer

    tok.save_pretrained(tmp_path / "tok")
    assert same_tokenizer("demo-char", tok, str(tmp_path / "tok"), AutoTokenizer.from_pretrained(tmp_path / "tok"))
    other = AutoTokenizer.from_pretrained(tmp_path / "tok")
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"the data's tokenizer \('other'\) differs from the module's \('demo-char'\)"):
        same_tokenizer("demo-char", tok, "other", other)


def test_token_ids_and_prompt_lengths_checked_before_training(tok):
    import lightning as L

    from models import tiny_rl_config
    from rlexact import RLModule
    from rlexact.trainer.data_checks import check_token_ids

    with pytest.raises(ValueError, match="contain token id 60, but the model's vocabulary has 50 tokens"):
        check_token_ids(60, 50, "d.jsonl")

    def fit(rows, max_new_tokens, vocab=None):
        config = tiny_rl_config(vocab or len(tok), max_pos=16)
        module = RLModule(model_config=config, tokenizer=tok, reward="arithmetic",
                          rollout={"n": 2, "max_new_tokens": max_new_tokens})  # fmt: skip
        trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu")  # fmt: skip
        trainer.fit(module, datamodule=PromptDataModule(rows, tokenizer=tok, batch_size=2))
        return module

    rows = [{"prompt": "1+1="}, {"prompt": "12345+12345="}]
    with pytest.raises(ValueError, match=r"longest prompt \(dataset row 1\) has 12 tokens.*max_prompt_length=6"):
        fit(rows, max_new_tokens=10)
    with pytest.raises(ValueError, match="contain token id .* but the model's vocabulary has 8 tokens"):
        fit(rows, max_new_tokens=2, vocab=8)


def test_resumable_loader_needs_its_sampler():
    from torch.utils.data import SequentialSampler

    from rlexact.data import ResumableDataLoader

    with pytest.raises(TypeError, match="ResumableDataLoader needs a ResumableSampler, got SequentialSampler"):
        ResumableDataLoader([1, 2], sampler=SequentialSampler([1, 2]))
