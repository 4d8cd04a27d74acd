"""Tests of prepare_data.py, on small data made in tmp_path; downloads come from file:// or localhost fixtures."""
import gzip
import http.server
import json
import lzma
import os
import random
import socket
import subprocess
import sys
import sysconfig
import threading
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load

import prepare_data as pd

ROOT = Path(__file__).resolve().parents[1]


def error_of(argv):
    """Run main(argv), expect a user error, and return its message, checked to be one line."""
    with pytest.raises(SystemExit) as e:
        pd.main(argv)
    message = str(e.value.code)
    assert message.startswith("prepare_data.py: error: ") and "\n" not in message
    return message


def split_docs(stream, eot):
    """Cut a token stream that starts with EOT into its documents."""
    assert stream[0] == eot
    cuts = np.flatnonzero(stream == eot)
    return [stream[a + 1:b] for a, b in zip(cuts, list(cuts[1:]) + [len(stream)])]


def load_split(data_dir, split):
    """meta.json and the concatenated tokens of one split."""
    meta = json.loads((data_dir / "meta.json").read_text())
    return meta, np.concatenate([pd.read_shard(data_dir / s) for s in meta["splits"][split]["shards"]])


# -----------------------------------------------------------------------------
# Shards

def test_shard_round_trip_and_header(tmp_path):
    tokens = np.array([0, 1, 256, 50256, 65535], dtype=np.uint16)
    pd.write_shard(tmp_path / "s.bin", tokens)
    header = np.fromfile(tmp_path / "s.bin", dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, 1, 5] and not header[3:].any()
    assert (tmp_path / "s.bin").stat().st_size == 1024 + 2 * 5
    back = pd.read_shard(tmp_path / "s.bin")
    assert back.dtype == np.uint16 and back.tolist() == tokens.tolist()
    pd.write_shard(tmp_path / "empty.bin", [])
    assert pd.read_shard(tmp_path / "empty.bin").size == 0


def test_corrupt_shards_give_one_line_errors(tmp_path):
    path = tmp_path / "s.bin"
    pd.write_shard(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    with pytest.raises(SystemExit, match=r"s\.bin holds 98 tokens but its header says 100 \(truncated\?\)"):
        pd.read_shard(path)
    data = bytearray((tmp_path / "s.bin").read_bytes())
    data[0] ^= 1  # wrong magic
    path.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="s.bin is not an llm.c token shard"):
        pd.read_shard(path)
    path.write_bytes(b"\0" * 10)  # shorter than a header
    with pytest.raises(SystemExit, match="not an llm.c token shard"):
        pd.num_tokens(path)


# -----------------------------------------------------------------------------
# text and stdlib with the byte tokenizer

def make_folder(root):
    """A small folder of text files, plus a hidden dir and a binary file that must be skipped."""
    files = {"doc0.txt": "hello world\n" * 3, "doc2.txt": "naïve café 日本語 🚀\n", "doc4.txt": "x = 1\n",
             "sub/deep.txt": "deep\nfile\n", "notes.md": "# notes <|endoftext|> stay text\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "image.bin").write_bytes(b"\x89PNG\0\0\0")
    return files


def test_text_byte_split_by_whole_files(tmp_path):
    files = make_folder(tmp_path / "corpus")
    is_val = {name: zlib.crc32(name.encode()) % 100 < 30 for name in files}
    assert any(is_val.values()) and not all(is_val.values())  # the fixture exercises both sides
    out = tmp_path / "data"
    assert pd.main(["text", str(tmp_path / "corpus"), f"--data_dir={out}", "--val_percent=30", "--shard_tokens=7"]) == 0
    for split in ("train", "val"):
        meta, stream = load_split(out, split)
        expected = [files[n].encode() for n in sorted(files, key=lambda n: Path(n).parts) if is_val[n] == (split == "val")]
        if split == "train":  # train documents come in a fixed shuffled order; val stays in file order
            random.Random(0).shuffle(expected)
        assert [d.astype(np.uint8).tobytes() for d in split_docs(stream, 256)] == expected
        s = meta["splits"][split]
        assert s["docs"] == len(expected) and s["bytes"] == sum(map(len, expected))
        assert s["tokens"] == len(stream) == s["bytes"] + s["docs"]
        assert s["shards"] == [f"{split}_{i:06d}.bin" for i in range(-(-s["tokens"] // 7))]
    raw = b"\n".join(files[n].encode() for n in sorted(files, key=lambda n: Path(n).parts) if is_val[n])
    assert meta["val_gzip_bpb"] == pytest.approx(8 * len(gzip.compress(raw, compresslevel=9)) / len(raw))
    assert meta["val_xz_bpb"] == pytest.approx(8 * len(lzma.compress(raw, preset=9)) / len(raw))
    assert (meta["format"], meta["source"], meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == \
           ("trainsuite-text-1", "text", "byte", 257, 256)
    assert meta["pat_str"] is None and meta["tokenizer_file"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dir left behind


def test_text_single_file_holds_out_its_tail(tmp_path):
    text = "".join(f"line {i} of the only file\n" for i in range(40))
    (tmp_path / "book.txt").write_text(text)
    pd.main(["text", str(tmp_path / "book.txt"), f"--data_dir={tmp_path / 'data'}", "--val_percent=10"])
    _, train = load_split(tmp_path / "data", "train")
    _, val = load_split(tmp_path / "data", "val")
    head, tail = train[1:].astype(np.uint8).tobytes().decode(), val[1:].astype(np.uint8).tobytes().decode()
    assert head + tail == text and head.endswith("\n") and 0.05 < len(tail) / len(text) <= 0.15


def test_text_user_errors(tmp_path):
    assert "does not exist" in error_of(["text", str(tmp_path / "nope"), f"--data_dir={tmp_path / 'd'}"])
    (tmp_path / "empty").mkdir()
    assert "no text files found" in error_of(["text", str(tmp_path / "empty"), f"--data_dir={tmp_path / 'd'}"])
    assert "unrecognized arguments: --bogus=1" in error_of(["stdlib", "--bogus=1"])
    assert "unrecognized arguments: --shard=5" in error_of(["stdlib", "--shard=5"])  # not --shard_tokens
    assert "unknown tokenizer 'bpe'" in error_of(["stdlib", "--tokenizer=bpe"])
    assert "val_percent" in error_of(["stdlib", "--val_percent=0", f"--data_dir={tmp_path / 'd'}"])
    assert "1..103" in error_of(["fineweb", "--shards=0"])
    assert not (tmp_path / "d").exists()


def test_stdlib_skips_installed_packages(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    files = {"a.py": "A = 1\n", "pkg/b.py": "B = 2\n", "pkg/c.py": "C = 3\n", "site-packages/x.py": "X = 9\n",
             "pkg/dist-packages/y.py": "Y = 9\n", "notes.txt": "N = 9\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    pd.main(["stdlib", f"--data_dir={tmp_path / 'data'}", "--val_percent=10"])
    meta, train = load_split(tmp_path / "data", "train")
    _, val = load_split(tmp_path / "data", "val")
    # crc32 % 100: a.py 2, pkg/b.py 13, pkg/c.py 32, so a.py alone is val
    assert meta["splits"]["val"]["docs"] == 1 and meta["splits"]["train"]["docs"] == 2
    assert val[1:].astype(np.uint8).tobytes() == b"A = 1\n"
    assert train.astype(np.uint8).tobytes().replace(b"\x00", b"") == b"B = 2\nC = 3\n"  # EOT 256 wraps to 0


def test_stdlib_real(tmp_path):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py"))
             if "site-packages" not in p.relative_to(root).parts and "dist-packages" not in p.relative_to(root).parts]
    text = {f: (root / f).read_bytes().decode(errors="replace") for f in files}
    first_copy = {}  # each text once, at its first path (the stdlib repeats a few files, e.g. empty ones)
    for f in files:
        first_copy.setdefault(text[f], f)
    text = {f: text[f] for f in first_copy.values()}
    files = list(text)
    files = [f for f in files if pd.junk_reason(text[f]) is None]  # the deliberately non-UTF-8 test modules are dropped
    val_files = [f for f in files if zlib.crc32(f.encode()) % 100 < 1]
    pd.main(["stdlib", f"--data_dir={tmp_path / 'data'}"])
    meta, val = load_split(tmp_path / "data", "val")
    assert sum(meta["junk_docs"]["found"].values()) == len(text) - len(files)
    assert meta["splits"]["val"]["docs"] == len(val_files) > 0
    assert meta["splits"]["train"]["docs"] == len(files) - len(val_files)
    assert meta["splits"]["train"]["bytes"] > 10_000_000
    first = split_docs(val, 256)[0].astype(np.uint8).tobytes()
    assert first == text[val_files[0]].encode()
    assert 0.5 < meta["val_xz_bpb"] < meta["val_gzip_bpb"] < 4


def test_failed_run_keeps_the_previous_data(tmp_path, monkeypatch):
    make_folder(tmp_path / "corpus")
    out = tmp_path / "data"
    pd.main(["text", str(tmp_path / "corpus"), f"--data_dir={out}", "--val_percent=30", "--tokenizer=bpe:260"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "tokenizer.tiktoken" in before and "meta.json" in before

    def broken(path, tokens):
        raise KeyboardInterrupt
    monkeypatch.setattr(pd, "write_shard", broken)
    with pytest.raises(SystemExit, match="interrupted: nothing half-written is left"):
        pd.main(["text", str(tmp_path / "corpus"), f"--data_dir={out}", "--val_percent=30"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"]  # staging dir removed
    monkeypatch.undo()
    pd.main(["text", str(tmp_path / "corpus"), f"--data_dir={out}", "--val_percent=30"])  # byte now: no stale tokenizer
    assert not (out / "tokenizer.tiktoken").exists() and json.loads((out / "meta.json").read_text())["vocab_size"] == 257


# -----------------------------------------------------------------------------
# BPE

def naive_bpe(counts, vocab_size):
    """Reference BPE: recount every pair before each merge, ties to the smaller ids."""
    words, freq = [list(c) for c in counts], list(counts.values())
    vocab = [bytes([i]) for i in range(256)]
    while len(vocab) < vocab_size - 1:
        pairs = Counter()
        for word, f in zip(words, freq):
            for p in zip(word, word[1:]):
                pairs[p] += f
        pair = min(pairs, key=lambda p: (-pairs[p], p))
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        words = [pd.merge(w, pair, len(vocab) - 1) for w in words]
    return {b: i for i, b in enumerate(vocab)}


def test_bpe_merges_most_frequent_pairs():
    # the Hugging Face course example: "ug" (20), then "un" (16), then "hug" (15)
    counts = Counter({b"hug": 10, b"pug": 5, b"pun": 12, b"bun": 4, b"hugs": 5})
    ranks = pd.train_bpe(counts, 260)
    assert [b for b, r in sorted(ranks.items(), key=lambda x: x[1])][256:] == [b"ug", b"un", b"hug"]
    assert [ranks[bytes([i])] for i in range(256)] == list(range(256))
    assert pd.train_bpe(Counter({b"cd": 1, b"ab": 1}), 258)[b"ab"] == 256  # tie: the smaller ids win


def test_bpe_matches_naive_reference():
    rng = random.Random(0)  # words over a small alphabet: many ties and overlaps such as "aaa"
    text = " ".join("".join(rng.choices("aabbcdeé日", k=rng.randint(1, 9))) for _ in range(3000))
    counts = Counter(c.encode() for c in pd.regex.findall(pd.PAT, text))
    ranks = pd.train_bpe(text, 600)
    assert ranks == pd.train_bpe(counts, 600) == naive_bpe(counts, 600)


def test_bpe_vocab_limits(tmp_path):
    with pytest.raises(SystemExit, match="at least 257"):
        pd.train_bpe("hello", 256)
    with pytest.raises(SystemExit, match="at most 65535"):
        pd.train_bpe("hello", 65536)
    assert "at most 65535" in error_of(["stdlib", "--tokenizer=bpe:70000", f"--data_dir={tmp_path / 'd'}"])
    assert "at least 257" in error_of(["stdlib", "--tokenizer=bpe:100", f"--data_dir={tmp_path / 'd'}"])
    with pytest.raises(SystemExit, match="allows only 2 merges"):
        pd.train_bpe("abc", 300)


def test_bpe_tokenizer_file_round_trips_through_tiktoken(tmp_path, monkeypatch):
    files = make_folder(tmp_path / "corpus")
    out = tmp_path / "data"
    pd.main(["text", str(tmp_path / "corpus"), f"--data_dir={out}", "--val_percent=30", "--tokenizer=bpe:300"])
    meta, train = load_split(out, "train")
    assert (meta["vocab_size"], meta["eot_id"], meta["tokenizer_file"], meta["pat_str"]) == \
           (300, 299, "tokenizer.tiktoken", pd.PAT)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # "" turns off tiktoken's cache of files by path
    ranks = tiktoken.load.load_tiktoken_bpe(str(out / "tokenizer.tiktoken"))
    assert sorted(ranks.values()) == list(range(299)) and all(ranks[bytes([i])] == i for i in range(256))
    enc = tiktoken.Encoding("t", pat_str=meta["pat_str"], mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 299})
    for text in ["hello world", "naïve café 日本語 🚀 \x00\t\r\n  end", "<|endoftext|> as text", ""]:
        assert enc.decode(enc.encode_ordinary(text)) == text
    assert len(enc.encode_ordinary("hello world\n" * 3)) < len("hello world\n" * 3)  # merges were learned
    is_val = {n: zlib.crc32(n.encode()) % 100 < 30 for n in files}
    expected = [files[n] for n in sorted(files, key=lambda n: Path(n).parts) if not is_val[n]]
    random.Random(0).shuffle(expected)
    assert [enc.decode(d.tolist()) for d in split_docs(train, 299)] == expected


def test_gpt2_without_its_files_is_a_one_line_error(tmp_path, monkeypatch):
    make_folder(tmp_path / "corpus")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))

    def offline(name):
        raise ConnectionError("no network")  # what tiktoken raises offline, without waiting for it
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    message = error_of(["text", str(tmp_path / "corpus"), f"--data_dir={tmp_path / 'data'}", "--tokenizer=gpt2"])
    assert "TIKTOKEN_CACHE_DIR" in message and "--tokenizer=byte" in message and "bpe:N" in message
    assert not (tmp_path / "data" / "meta.json").exists()


# -----------------------------------------------------------------------------
# Downloads, from file:// and localhost fixtures

def test_shakespeare_from_a_file_url(tmp_path, monkeypatch):
    text = "".join(f"CITIZEN {i}:\nSpeak, speak.\n\n" for i in range(50))
    (tmp_path / "input.txt").write_text(text)
    monkeypatch.setattr(pd, "SHAKESPEARE_URL", (tmp_path / "input.txt").as_uri())
    out = tmp_path / "data"
    pd.main(["shakespeare", f"--data_dir={out}"])
    assert (out / "input.txt").read_text() == text and not (out / "input.txt.part").exists()
    meta, train = load_split(out, "train")
    _, val = load_split(out, "val")
    head, tail = train[1:].astype(np.uint8).tobytes().decode(), val[1:].astype(np.uint8).tobytes().decode()
    assert head + tail == text and head.endswith("\n") and 0.1 <= len(tail) / len(text) < 0.15
    assert meta["source"] == "shakespeare" and meta["splits"]["train"]["docs"] == meta["splits"]["val"]["docs"] == 1


def fake_fineweb(folder):
    """Three tiny shards named and laid out as in kjj0/fineweb10B-gpt2: each document starts with EOT 50256."""
    folder.mkdir()
    shards = {"fineweb_val_000000.bin": [50256, 15496, 995, 50256, 40, 1101, 13],
              "fineweb_train_000001.bin": [50256, 464, 3797, 3332, 319],
              "fineweb_train_000002.bin": [50256, 1169, 50256, 3290, 50256, 0]}
    for name, tokens in shards.items():
        pd.write_shard(folder / name, tokens)
    return shards


class FakeGPT2:
    n_vocab, eot_token = 50257, 50256

    def decode_single_token_bytes(self, t):
        return b"x" * (t % 3 + 1)


@pytest.mark.parametrize("have_gpt2", [False, True])
def test_fineweb_from_file_urls(tmp_path, monkeypatch, have_gpt2):
    shards = fake_fineweb(tmp_path / "hf")
    monkeypatch.setattr(pd, "FINEWEB_URL", (tmp_path / "hf").as_uri() + "/")

    def get_encoding(name):
        if not have_gpt2:
            raise ConnectionError("no network")
        return FakeGPT2()
    monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)
    out = tmp_path / "data"
    pd.main(["fineweb", "--shards=2", f"--data_dir={out}"])
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["source"], meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("fineweb", "gpt2", 50257, 50256)
    assert meta["splits"]["train"] == dict(tokens=11, bytes=None, docs=None,
                                           shards=["fineweb_train_000001.bin", "fineweb_train_000002.bin"])
    val = shards["fineweb_val_000000.bin"]
    assert meta["splits"]["val"]["tokens"] == 7 and meta["splits"]["val"]["docs"] == 2
    assert meta["splits"]["val"]["bytes"] == (sum(t % 3 + 1 for t in val if t != 50256) if have_gpt2 else None)
    assert meta["val_gzip_bpb"] is None and meta["val_xz_bpb"] is None
    for name, tokens in shards.items():
        assert pd.read_shard(out / name).tolist() == tokens


def test_download_skips_complete_files_and_restarts_without_range(tmp_path, monkeypatch):
    (tmp_path / "src.txt").write_bytes(b"0123456789" * 1000)
    (tmp_path / "done.txt").write_text("already here")
    pd.download((tmp_path / "missing").as_uri(), tmp_path / "done.txt")  # never fetched: it exists
    (tmp_path / "got.txt.part").write_bytes(b"junk")  # file:// ignores Range, so this must be discarded
    pd.download((tmp_path / "src.txt").as_uri(), tmp_path / "got.txt")
    assert (tmp_path / "got.txt").read_bytes() == b"0123456789" * 1000 and not (tmp_path / "got.txt.part").exists()


def test_download_resumes_with_a_range_request(tmp_path, monkeypatch):
    body, seen = bytes(range(256)) * 40, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            start = int(self.headers.get("Range", "bytes=0-")[6:-1])
            seen.append(start)
            self.send_response(206)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self.wfile.write(body[start:])

        def log_message(self, *args):
            pass
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "f.bin.part").write_bytes(body[:1000])
        pd.download(f"http://127.0.0.1:{server.server_port}/f.bin", tmp_path / "f.bin")
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [1000] and (tmp_path / "f.bin").read_bytes() == body


def test_offline_download_is_a_one_line_error(tmp_path, monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(pd, "SHAKESPEARE_URL", f"http://127.0.0.1:{port}/input.txt")
    message = error_of(["shakespeare", f"--data_dir={tmp_path / 'data'}"])
    assert message.startswith(f"prepare_data.py: error: cannot download http://127.0.0.1:{port}/input.txt (")
    assert message.endswith("offline? use 'python prepare_data.py stdlib' or 'python prepare_data.py text PATH...' instead")
    monkeypatch.setattr(pd, "FINEWEB_URL", (tmp_path / "nowhere").as_uri() + "/")
    assert "cannot download file://" in error_of(["fineweb", "--shards=1", f"--data_dir={tmp_path / 'fw'}"])
    assert not (tmp_path / "data" / "meta.json").exists() and not (tmp_path / "fw" / "meta.json").exists()
    monkeypatch.setattr(pd, "GPT2_URL", (tmp_path / "nowhere").as_uri() + "/")
    assert error_of(["gpt2", f"--data_dir={tmp_path / 'gpt2'}"]).endswith(
        "offline? use --init_from=FOLDER with a Hugging Face GPT-2 folder you have (config.json, model.safetensors) instead")
    assert not (tmp_path / "gpt2").exists()  # nothing fetched, nothing left behind
    monkeypatch.setattr(pd, "HELLASWAG_URL", (tmp_path / "nowhere" / "hellaswag_val.jsonl").as_uri())
    assert error_of(["hellaswag", f"--data_dir={tmp_path / 'hs'}"]).endswith("offline? use eval_gpt.py --items=FILE, items of "
                                                                             "your own (a JSON line each: ctx, endings, label) instead")
    assert not (tmp_path / "hs").exists()


def test_hellaswag_is_fetched_once_as_it_is(tmp_path, monkeypatch, capsys):
    """prepare_data.py hellaswag keeps the val set's JSONL as published (the trainers tokenize it with their own
    tokenizer) and counts its items; a second run downloads nothing."""
    from conftest import hellaswag_items
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("".join(json.dumps(item) + "\n" for item in hellaswag_items(25)))
    monkeypatch.setattr(pd, "HELLASWAG_URL", src.as_uri())
    pd.main(["hellaswag", f"--data_dir={tmp_path / 'hs'}"])
    assert (tmp_path / "hs" / "hellaswag_val.jsonl").read_bytes() == src.read_bytes()
    assert "25 items in" in capsys.readouterr().out
    src.unlink()
    pd.main(["hellaswag", f"--data_dir={tmp_path / 'hs'}"])  # the file is there: nothing is fetched


# -----------------------------------------------------------------------------
# As a script

def test_script_errors_are_one_line_and_import_does_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "stdlib", "--bogus"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("prepare_data.py: error: unrecognized arguments: --bogus")
    r = subprocess.run([sys.executable, "-c", "import prepare_data"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == r.stderr == "" and list(tmp_path.iterdir()) == []


def test_pathological_documents_are_dropped_and_counted(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"ok{i}.txt").write_text(f"a normal document number {i}\n" * 20)
    (src / "repeat.txt").write_text("start " + "=" * 5000 + " end")
    (src / "binary.txt").write_bytes(bytes(range(1, 256)) * 20)  # no NUL byte, so not skipped as a binary file
    pd.main(["text", str(src), f"--data_dir={tmp_path}/d", "--val_percent=10"])
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["junk_docs"]["found"] == {"binary or mis-encoded": 1, "a character repeated 1,000+ times": 1}
    assert meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"] == 40
    pd.main(["text", str(src), f"--data_dir={tmp_path}/k", "--val_percent=10", "--junk=keep"])
    meta = json.loads((tmp_path / "k" / "meta.json").read_text())
    assert meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"] == 42


def test_a_file_copied_under_another_path_is_kept_once(capsys):
    """Exact copies are dropped before the split, so a val file's text never also sits in train."""
    val_name = next(f"v{i}.py" for i in range(100) if zlib.crc32(f"v{i}.py".encode()) % 100 < 30)
    train_name = next(f"t{i}.py" for i in range(100) if zlib.crc32(f"t{i}.py".encode()) % 100 >= 30)
    named = [(val_name, "the same text\n"), (train_name, "the same text\n"), ("other.py", "other text\n")]
    train, val = pd.split_files(named, 30)
    assert sorted(train + val) == ["other text\n", "the same text\n"] and "the same text\n" in val
    assert "dropped 1 file(s)" in capsys.readouterr().out


def test_every_flag_of_every_subcommand_has_help(capsys):
    """Issue 80: `prepare_data.py SUBCOMMAND -h` gives each flag a line of help, --data_dir and GPT-2's --model too."""
    import re
    for command in ("text", "stdlib", "shakespeare", "fineweb", "gpt2", "hellaswag", "shapes", "cifar10", "cifar100",
                    "mnist", "fashion_mnist", "imagefolder"):
        with pytest.raises(SystemExit):
            pd.main([command, "-h"])
        text = capsys.readouterr().out.split("options:")[1]
        blocks = re.split(r"\n(?=  --)", text.strip())[1:]  # each flag's: its name (and metavar), then its help
        bare = [b.split()[0] for b in blocks if len(b.split()) <= 2]
        assert blocks and not bare, (command, bare)
