"""Data loading, the prompt template, masking, truncation and bucketing in train_local.py."""
import functools
import http.server
import json
import threading

import numpy as np
import pytest
import sentencepiece as spm

import train_local
from conftest import SAMPLE_DATA


def args_for(data, **overrides):
    args = train_local.parse_args(["--data", str(data)])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def write_lines(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"instruction": "Say hi.", "context": "", "response": "Hi!", "category": "open_qa"})


class FakeTokenizer:
    start_token_id, end_token_id, pad_token_id = 2, 1, 0


@pytest.fixture(scope="module")
def encode(tiny_model):
    return spm.SentencePieceProcessor(model_file=str(tiny_model / "tokenizer.model")).encode


def test_article_template_is_exact():
    record = {"instruction": "Explain LoRA.", "context": "Some context.", "response": "It is low-rank."}
    prompt = train_local.format_prompt(record, args_for(SAMPLE_DATA))
    assert prompt == "Instruction:\nExplain LoRA.\n\nResponse:\n"
    assert prompt + record["response"] == "Instruction:\nExplain LoRA.\n\nResponse:\nIt is low-rank."


def test_context_template_only_with_flag_and_non_empty_context():
    args = args_for(SAMPLE_DATA, use_context=True)
    with_context = {"instruction": "Summarise.", "context": "A long text.", "response": "Short."}
    assert train_local.format_prompt(with_context, args) == \
        "Instruction:\nSummarise.\n\nContext:\nA long text.\n\nResponse:\n"
    assert train_local.format_prompt(dict(with_context, context=""), args) == \
        "Instruction:\nSummarise.\n\nResponse:\n"


def test_gemma_chat_template_wraps_turns_and_ends_answers_with_end_of_turn(tmp_path, encode, tiny_model):
    path = write_lines(tmp_path, [json.dumps({"instruction": "Summarise.", "context": "A text.", "response": "Short."})])
    train, _ = train_local.load_data(args_for(path, template="gemma-chat", use_context=True, eval_examples=0))
    assert train == [[("<start_of_turn>user\nSummarise.\n\nA text.<end_of_turn>\n<start_of_turn>model\n", "prompt"),
                      ("Short.<end_of_turn>", "answer")]]
    # The tiny tokenizer, like Gemma 2/3's, has the markers as single tokens: the answer ends <end_of_turn> <eos>.
    [(ids, weights)], _, _ = train_local.tokenize(train, encode, FakeTokenizer, 64, "response")
    end_of_turn = spm.SentencePieceProcessor(model_file=str(tiny_model / "tokenizer.model")).piece_to_id("<end_of_turn>")
    assert encode("<end_of_turn>") == [end_of_turn]
    assert ids[-2:].tolist() == [end_of_turn, FakeTokenizer.end_token_id] and weights[-2:].tolist() == [1.0, 1.0]


def test_custom_field_names(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"q": "Why?", "a": "Because."})])
    args = args_for(path, instruction_field="q", response_field="a", eval_examples=0)
    train, _ = train_local.load_data(args)
    assert train == [[("Instruction:\nWhy?\n\nResponse:\n", "prompt"), ("Because.", "answer")]]


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    (json.dumps({"instruction": "x"}), "missing field 'response'"),
    (json.dumps({"instruction": 3, "response": "y"}), "field 'instruction' is int"),
])
def test_bad_line_is_a_clear_error_naming_file_and_line(tmp_path, bad_line, reason):
    path = write_lines(tmp_path, [GOOD, GOOD, bad_line, GOOD])
    with pytest.raises(train_local.UserError) as error:
        train_local.load_data(args_for(path))
    assert f"{path}:3:" in str(error.value) and reason in str(error.value)
    assert "--skip-bad-lines" in str(error.value)


def test_skip_bad_lines_skips_and_counts(tmp_path, capsys):
    path = write_lines(tmp_path, [GOOD, "{oops", "42", GOOD, json.dumps({"instruction": "a", "response": None})])
    train, _ = train_local.load_data(args_for(path, skip_bad_lines=True, eval_examples=0))
    assert len(train) == 2
    assert "skipped 3 bad records" in capsys.readouterr().out


def test_non_string_context_is_bad_only_when_context_is_used(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"instruction": "a", "context": 5, "response": "b"})])
    assert len(train_local.load_data(args_for(path, eval_examples=0))[0]) == 1
    with pytest.raises(train_local.UserError, match="field 'context' is int"):
        train_local.load_data(args_for(path, use_context=True, eval_examples=0))


def test_empty_dataset_is_an_error(tmp_path):
    path = write_lines(tmp_path, ["", "   "])
    with pytest.raises(train_local.UserError, match="no usable records"):
        train_local.load_data(args_for(path))


def test_eval_records_come_after_the_training_slice(tmp_path, capsys):
    records = [json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) for i in range(10)]
    path = write_lines(tmp_path, records)
    train, held_out = train_local.load_data(args_for(path, limit=6, eval_examples=3))
    assert [answer for (_, (answer, _)) in train] == [f"a{i}" for i in range(6)]
    assert [answer for (_, (answer, _)) in held_out] == ["a6", "a7", "a8"]
    train, held_out = train_local.load_data(args_for(path, limit=8, eval_examples=5))
    assert [answer for (_, (answer, _)) in held_out] == ["a8", "a9"]
    assert "only 2 records remain" in capsys.readouterr().out


def test_limit_zero_means_all(tmp_path):
    path = write_lines(tmp_path, [GOOD] * 7)
    train, _ = train_local.load_data(args_for(path, limit=0, eval_examples=0))
    assert len(train) == 7


def test_sample_data_has_dolly_schema_and_variety():
    records = [json.loads(line) for line in SAMPLE_DATA.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 200
    assert all(set(r) == {"instruction", "context", "response", "category"} for r in records)
    assert any(r["context"] == "" for r in records) and any(len(r["context"]) > 2000 for r in records)
    assert any("\n" in r["response"] for r in records)
    assert any(any(ord(c) > 0x3000 for c in r["response"]) for r in records)


def pair(prompt, answer):
    return [(prompt, "prompt"), (answer, "answer")]


def test_loss_on_response_gives_prompt_tokens_zero_weight(encode):
    pairs = [pair("Instruction:\nWhat is 2 plus 2?\n\nResponse:\n", "4.")]
    [(ids_all, w_all)], _, _ = train_local.tokenize(pairs, encode, FakeTokenizer, 512, "all")
    [(ids, weights)], _, _ = train_local.tokenize(pairs, encode, FakeTokenizer, 512, "response")
    prompt_len = 1 + len(encode(pairs[0][0][0]))  # <bos> + prompt
    assert ids.tolist() == ids_all.tolist() == [2] + encode(pairs[0][0][0]) + encode("4.") + [1]
    assert w_all.tolist() == [1.0] * (len(ids) - 1)
    # weights[i] scores the prediction of ids[i + 1]: prompt tokens (after <bos>) weigh 0, response and <eos> 1.
    assert weights[: prompt_len - 1].sum() == 0
    assert weights[prompt_len - 1:].tolist() == [1.0] * (len(ids) - prompt_len)


def test_truncation_is_counted_and_drops_eos(encode):
    long_response = "word " * 300
    pairs = [pair("Instruction:\nx\n\nResponse:\n", long_response), pair("Instruction:\ny\n\nResponse:\n", "short")]
    examples, truncated, cut = train_local.tokenize(pairs, encode, FakeTokenizer, 64, "all")
    full = 1 + len(encode(pairs[0][0][0])) + len(encode(long_response)) + 1
    assert truncated == 1 and cut == full - 65
    assert len(examples[0][0]) == 65 and examples[0][0][-1] != 1
    assert examples[1][0][-1] == 1


def test_buckets():
    assert train_local.parse_buckets("auto", 512) == [128, 256, 512]
    assert train_local.parse_buckets("512", 512) == [512]
    assert train_local.parse_buckets("100,300,900", 512) == [100, 300, 512]
    with pytest.raises(train_local.UserError):
        train_local.parse_buckets("a,b", 512)


def test_batches_hold_every_example_once_in_the_smallest_fitting_bucket():
    rng = np.random.default_rng(0)
    examples = [(np.arange(n + 1, dtype=np.int32), np.ones(n, np.float32)) for n in rng.integers(3, 512, 203)]
    buckets = [128, 256, 512]
    batches = train_local.make_batches(examples, buckets, 4, np.random.default_rng(1))
    seen = sorted(i for _, indices in batches for i in indices)
    assert seen == list(range(len(examples)))
    for length, indices in batches:
        assert 1 <= len(indices) <= 4
        for i in indices:
            n = len(examples[i][0]) - 1
            assert n <= length and (length == buckets[0] or n > buckets[buckets.index(length) - 1])
    token_ids, mask, labels, weights = train_local.collate(examples, batches[0][1], batches[0][0], 4, 0)
    assert token_ids.shape == (4, batches[0][0]) and weights.sum() == sum(len(examples[i][1]) for i in batches[0][1])


def test_unreachable_url_says_to_pass_local_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(train_local.UserError, match="--data path/to/data.jsonl"):
        train_local.fetch("http://127.0.0.1:9/databricks-dolly-15k.jsonl")
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_download_is_atomic_and_reused(tmp_path, monkeypatch):
    served = tmp_path / "www"
    served.mkdir()
    (served / "data.jsonl").write_text(GOOD + "\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/data.jsonl"
    try:
        path = train_local.fetch(url)
        assert path.read_text() == GOOD + "\n" and not (work / "data.jsonl.part").exists()
    finally:
        httpd.shutdown()
    assert train_local.fetch(url) == path  # server is gone: the cached file is reused


def test_tiny_gemma_has_gemmas_layout_and_special_tokens(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "gemma" and (tiny_model / "model.safetensors").is_file()
    sp = spm.SentencePieceProcessor(model_file=str(tiny_model / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    text = "Instruction:\nÜber 日本 🎂\n\n  two spaces\n\nResponse:\n"
    assert sp.decode(sp.encode(text)) == text  # newlines, spaces and unseen characters (byte fallback) survive
