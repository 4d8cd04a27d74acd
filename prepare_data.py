"""
Prepare data for the trainers: one subcommand per source, each writing its --data_dir.

Text, for train_gpt.py:
    python prepare_data.py stdlib                          # default, no network: Python's own stdlib .py files
    python prepare_data.py stdlib --tokenizer=bpe:4353     # train a 4096-merge BPE on it first
    python prepare_data.py text PATH... --data_dir=data/mytext --tokenizer=gpt2
    python prepare_data.py shakespeare                     # downloads tinyshakespeare (1.1 MB)
    python prepare_data.py fineweb --shards=10             # downloads GPT-2 tokenized FineWeb-10B, 100M tokens a shard
    python prepare_data.py hellaswag                       # downloads HellaSwag's 10,042 val items, for eval_gpt.py
    python prepare_data.py core                            # downloads the DCLM eval bundle (CORE), for eval_gpt.py

A text data dir holds llm.c shards (train_000000.bin, ..., val_000000.bin, ...; each document as [EOT] + tokens)
and meta.json, written last: a dir without meta.json is not prepared. --tokenizer: byte (EOT 256), gpt2 (tiktoken,
EOT 50256), or bpe:N (a byte-level BPE trained on the train split, N tokens in all, EOT N-1). docs/data.md has more.

Why this format: a trainer reads tokens, not text, so the text is tokenized once here and never again. A token id
below 65,536 fits in two bytes, so a shard is uint16, half the disk and memory of int32, and nanoGPT's train.bin is
the same array with no header (train_gpt.py reads both). llm.c's 1 KB header adds a magic number, a version and the
token count, so a truncated or foreign file is caught before training on it. The trainer memory-maps each shard: the
OS pages in what is read, so a corpus larger than RAM trains as well as a small one. Shards of at most 100M tokens
(200 MB) keep each file a download that resumes on its own and a map that stays small.

Images, for train_vit.py and train_diffusion.py:
    python prepare_data.py shapes                          # no network: 10 procedural shapes, 50,000 + 10,000 images
    python prepare_data.py cifar10                         # downloads CIFAR-10 (170 MB); cifar100 [--labels=coarse] too
    python prepare_data.py mnist                           # downloads MNIST (12 MB); fashion_mnist (31 MB) too
    python prepare_data.py imagefolder PATH --image_size=64   # your images, PATH/CLASS/*.png|jpg|jpeg|bmp|webp

An image data dir holds {train,val}_images.npy, uint8 (N, H, W, C), {train,val}_labels.npy, int64, and meta.json,
written last: classes, image_size, channels, the train pixels' mean and std, and flip_ok (the trainers flip only then).
imagefolder decodes its images in --workers processes (default: one per CPU) and writes them to the arrays a chunk
of about 2 MiB at a time, so a folder larger than memory (ImageNet: 193 GB at 224x224) prepares in little memory.

Every command builds its files in a hidden folder beside --data_dir and moves them in at the end, meta.json last: a
command killed at any point leaves the old data (or none), never a folder that looks prepared but is half-written.
"""
import argparse
import base64
import contextlib
import csv
import difflib
import gzip
import hashlib
import heapq
import io
import json
import lzma
import math
import os
import pickle
import random
import shutil
import signal
import sys
import sysconfig
import tarfile
import tempfile
import time
import urllib.request
import zipfile
import zlib
from collections import Counter, defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import regex
import tiktoken

# -----------------------------------------------------------------------------
# Config

# every address this script downloads from, as module constants, so that a mirror (or a test) can point elsewhere
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# the DCLM eval bundle (CORE's 22 tasks, Li et al. 2024) where nanochat fetches it
CORE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
FINEWEB_URL = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main/"  # + fineweb_{val,train}_%06d.bin
GPT2_URL = "https://huggingface.co/openai-community/"  # + MODEL/resolve/main/FILE
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # + the IDX file names; the mirror torchvision uses
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# llm.c's shard header: 256 int32, of which the first three are the magic number, the version and the token count
MAGIC = 20240520
VERSION = 1
HEADER_BYTES = 1024
# the end-of-text token as GPT-2 spells it; a bpe:N tokenizer gives it the last id, N - 1
EOT = "<|endoftext|>"
# GPT-4's (cl100k) pre-split: no merge crosses a chunk: a word, up to 3 digits, a run of punctuation or of whitespace.
# Without it BPE would learn tokens such as "dog." and "dog!" beside "dog", spending the vocabulary on
# punctuation glued to words; with it, numbers split into at most 3 digits, which keeps arithmetic regular.
PAT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
       r"""\s+(?!\S)|\s""")

def fail(message):
    """Stop with a one-line error that names the problem and the fix: a non-zero exit, no traceback."""
    raise SystemExit(f"prepare_data.py: error: {message}")

@contextlib.contextmanager
def leaving_nothing_new(folder):
    """Run the body; if it fails or is interrupted, remove the folders that it made on the way to `folder` and left
    empty, so that a failed command leaves nothing new behind. A partial download stays: the next run resumes it."""
    folder = Path(folder)
    new = [p for p in [folder, *folder.parents] if not p.exists()]  # deepest first
    try:
        yield
    except BaseException:
        for p in new:
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise

@contextlib.contextmanager
def staging(data_dir, die=fail):
    """A hidden folder beside data_dir (made first) to build files in, which the caller moves into data_dir at the
    end: a run killed halfway leaves the previous data (or none) in data_dir, never a mix that looks prepared.
    die: the calling script's one-line error (chat_gpt.py --prepare stages here too)."""
    # beside data_dir, on the same file system, so that the final os.replace is a rename: atomic, and no copy
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{data_dir.name}.tmp-", dir=data_dir.parent))
    except OSError as e:
        # a file where a folder goes, or a folder this process may not write
        die(f"{e.filename}: {(e.strerror or type(e).__name__).lower()}; pass a --data_dir in a folder you can write")
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)

def publish(stage, data_dir, meta, old=()):
    """Move the staged files into data_dir with meta.json written last; `old`: files of a previous preparation."""
    # Each os.replace is atomic, but a folder of files cannot be replaced at once. So the old meta.json goes first,
    # the old files next, and the new meta.json is the last move: at every moment in between, data_dir has no
    # meta.json, and a trainer refuses it as not prepared rather than reading old and new shards together.
    (stage / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (data_dir / "meta.json").unlink(missing_ok=True)
    for path in old:
        if path.is_dir():  # a folder of the published layout, such as the CORE bundle's eval_data/
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
    for f in sorted(stage.iterdir(), key=lambda f: f.name == "meta.json"):  # meta.json last
        os.replace(f, data_dir / f.name)

# -----------------------------------------------------------------------------
# Shards

def write_shard(path, tokens):
    """Write tokens as an llm.c shard: a 256-int32 header (magic, version, count), then uint16 tokens."""
    tokens = np.asarray(tokens)
    fits = tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2**16)
    assert fits, "tokens must fit in uint16"
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    # "<": little-endian whatever the machine, as llm.c and nanoGPT write them
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())

def num_tokens(path):
    """Token count of an llm.c shard from its header, checked against the file size."""
    size = os.path.getsize(path)
    header = None
    if size >= HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=3)
    if header is None or header[0] != MAGIC or header[1] != VERSION:
        fail(f"{path} is not an llm.c token shard (bad header); delete it and prepare the data again")
    # the count against the size: a copy cut short, or a shard still being written, is caught here
    if size != HEADER_BYTES + 2 * int(header[2]):
        fail(f"{path} holds {(size - HEADER_BYTES) // 2} tokens but its header says {header[2]} (truncated?); "
             "delete it and prepare the data again")
    return int(header[2])

def read_shard(path):
    """Read an llm.c shard into a uint16 array, after checking magic, version and token count."""
    num_tokens(path)
    return np.fromfile(path, dtype="<u2", offset=HEADER_BYTES)

# -----------------------------------------------------------------------------
# Tokenizers
#
# Three kinds. byte: each UTF-8 byte is a token, 256 of them plus EOT; nothing to train, nothing unknown, but a
# sequence of T tokens holds only T bytes of text. gpt2: GPT-2's 50,257-token BPE, through tiktoken; a token holds
# about 4 bytes of English, but its embedding and head are large for a small model. bpe:N: a byte-level BPE trained
# here on the train split, N tokens in all: a vocabulary sized to the model and the data (the stdlib's default, 4,353,
# is 256 bytes + 4,096 merges + EOT). Every kind starts from bytes, so any text encodes, and none has an unknown token.

def check_bpe_vocab(n):
    """Refuse a bpe:N vocabulary too small for the 256 bytes + EOT, or too large for uint16 token ids."""
    if not 257 <= n <= 65535:
        fail(f"bpe:{n}: N must be at least 257 (256 byte tokens + the end-of-text token) and at most 65535 "
             "(token ids are stored as uint16); try bpe:4353")

def tokenizer_spec(s):
    """argparse type of --tokenizer: byte, gpt2, or bpe:N with 257 <= N <= 65535."""
    if s.startswith("bpe:") and s[4:].isdigit():
        check_bpe_vocab(int(s[4:]))
    elif s not in ("byte", "gpt2"):
        raise argparse.ArgumentTypeError(f"unknown tokenizer {s!r}; use byte, gpt2 or bpe:N (e.g. bpe:4353)")
    return s

def merge(word, pair, new):
    """Replace each occurrence of pair in word, left to right, by the token new."""
    out = []
    i = 0
    while i < len(word):
        hit = (i + 1 < len(word)
               and word[i] == pair[0]
               and word[i + 1] == pair[1])
        if hit:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out

def train_bpe(counts, vocab_size):
    """A byte-level BPE of {chunk: count} or a text, as tiktoken's mergeable_ranks {bytes: rank} (0..vocab_size-2)."""
    # BPE (Sennrich et al. 2016; byte-level as in GPT-2): start from the 256 bytes, then again and again merge the
    # most frequent adjacent pair of tokens into a new token, until the vocabulary has its size. A token's rank is
    # the order of its merge, and encoding replays the merges in that order, which is all tiktoken needs.
    check_bpe_vocab(vocab_size)
    if isinstance(counts, str):
        counts = Counter(regex.findall(PAT, counts))
    # each unique chunk is a word of token ids weighted by its count, and a merge only visits the words
    # that hold its pair: the 4096 merges on the stdlib take seconds, not a pass over 31 MB each
    words = []
    for c in counts:
        if isinstance(c, str):
            c = c.encode()
        words.append(list(c))
    freq = list(counts.values())
    vocab = [bytes([i]) for i in range(256)]  # token id (= rank) -> bytes
    pair_counts = defaultdict(int)  # pair -> occurrences
    where = defaultdict(set)  # pair -> the words holding it
    for w, word in enumerate(words):
        for p in zip(word, word[1:]):
            pair_counts[p] += freq[w]
            where[p].add(w)
    # a heap gives the most frequent pair without sorting them all after each merge; a merge changes the counts of a
    # few pairs only, and a popped entry whose count is stale is put back with its count of now
    # max count first, ties to the smaller ids: deterministic
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    t0 = time.time()
    n_merges = vocab_size - 257
    while len(vocab) < vocab_size - 1:
        if not heap:
            fail(f"the training text allows only {len(vocab) - 256} merges, fewer than bpe:{vocab_size} needs; "
                 "use a smaller N or more text")
        neg, pair = heapq.heappop(heap)
        c = pair_counts.get(pair, 0)
        if c != -neg:
            # stale: the count fell since this push (a rise always pushes), so re-queue it as it is now
            if c > 0:
                heapq.heappush(heap, (-c, pair))
            continue
        new = len(vocab)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        grown = set()
        for w in where.pop(pair):
            word = words[w]
            f = freq[w]
            new_word = merge(word, pair, new)
            words[w] = new_word
            if len(new_word) == len(word):
                # an earlier merge already took this word's pair
                continue
            # take the word's old pairs out of the counts and put its new ones in
            for p in zip(word, word[1:]):
                pair_counts[p] -= f
            for p in zip(new_word, new_word[1:]):
                pair_counts[p] += f
                where[p].add(w)
                if new in p:
                    # only pairs with the new token gain counts: all others lose or keep theirs
                    grown.add(p)
        for p in grown:
            heapq.heappush(heap, (-pair_counts[p], p))
        done = new - 255
        if done % max(1, n_merges // 8) == 0 or done == n_merges:
            print(f"bpe: {done}/{n_merges} merges | {time.time() - t0:.1f} s", flush=True)
    ranks = {b: i for i, b in enumerate(vocab)}
    # never seen; it would leave holes in the ranks
    assert len(ranks) == len(vocab), "two merges made the same token"
    return ranks

def encode_bytes(docs):
    """The byte tokenizer: each document's UTF-8 bytes are its tokens."""
    return [np.frombuffer(d.encode(), np.uint8) for d in docs]

def make_tokenizer(spec, train_docs, out_dir):
    """Return (encode: list of str -> list of token arrays, meta.json fields) for a --tokenizer spec."""
    if spec == "byte":
        info = dict(vocab_size=257, eot_id=256, pat_str=None, tokenizer_file=None)
        return encode_bytes, info
    if spec == "gpt2":
        try:
            # tiktoken downloads its gpt2 files on first use, then reads them from TIKTOKEN_CACHE_DIR
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            fail(f"cannot load tiktoken's gpt2 files ({type(e).__name__}); set TIKTOKEN_CACHE_DIR to a cache "
                 "that has them (or run once online), or use --tokenizer=byte or --tokenizer=bpe:N")
        info = dict(vocab_size=enc.n_vocab, eot_id=enc.eot_token, pat_str=None, tokenizer_file=None)
    else:
        n = int(spec[4:])
        # trained on the train split only: val text must not shape the tokenizer that its loss is measured with
        chunks = Counter(c for d in train_docs for c in regex.findall(PAT, d))
        ranks = train_bpe(chunks, n)
        # the format of tiktoken.load.load_tiktoken_bpe; beware that it caches any file by its path (in
        # TIKTOKEN_CACHE_DIR or /tmp/data-gym-cache), so it returns the old tokenizer after a re-train
        # a line per token: its bytes in base64, a space, its rank
        lines = [f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks.items()]
        (out_dir / "tokenizer.tiktoken").write_text("".join(lines))
        enc = tiktoken.Encoding(f"bpe_{n}", pat_str=PAT, mergeable_ranks=ranks, special_tokens={EOT: n - 1})
        info = dict(vocab_size=n, eot_id=n - 1, pat_str=PAT, tokenizer_file="tokenizer.tiktoken")

    def encode(docs):
        # encode_ordinary: a literal "<|endoftext|>" inside a document is text, not a document boundary
        batches = enc.encode_ordinary_batch(docs, num_threads=usable_cpus())
        return [np.array(t, np.uint16) for t in batches]
    return encode, info

# -----------------------------------------------------------------------------
# Downloads: the only network access in trainsuite

def download(url, path, instead="'python prepare_data.py stdlib' or 'python prepare_data.py text PATH...'"):
    """Fetch url to path (kept if there) with progress, resuming from path.part; `instead`: the offline way."""
    # The bytes go to path.part and are renamed to path only when complete, so a file at path is always whole and
    # a second run skips it. An interrupted download keeps its .part, and the next run asks the server for the
    # rest with an HTTP Range header: a 200 MB shard cut off at 190 MB costs 10 MB, not 200, to finish.
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    have = 0
    if part.exists():
        have = part.stat().st_size
    # timeout=60: a stalled connection fails within a minute, with a line that says to run again, instead of hanging
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            if r.status != 206:
                # the server (or a file:// URL) sent the whole file, not the rest
                have = 0
            length = r.headers.get("Content-Length")
            total = 0  # unknown without a Content-Length
            if length:
                total = have + int(length)
            n = have
            t0 = time.time()
            shown = 0.0
            with open(part, "ab" if have else "wb") as f:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    n += len(chunk)
                    if time.time() - shown > 0.5 or n == total:
                        shown = time.time()
                        rate = (n - have) / 1e6 / max(shown - t0, 1e-3)
                        print(f"\r{path.name}: {n / 1e6:.1f}/{total / 1e6:.1f} MB, {rate:.1f} MB/s",
                              end="", file=sys.stderr)
            print(file=sys.stderr)
    except OSError as e:
        # URLError, HTTPError, timeouts and connection resets are all OSErrors
        fail(f"cannot download {url} ({getattr(e, 'reason', e)}); offline? use {instead} instead")
    if total and n != total:
        fail(f"the download of {url} stopped at {n}/{total} bytes; run the same command again to resume")
    os.replace(part, path)

# -----------------------------------------------------------------------------
# Sources: a subcommand each; a text source returns (train documents, val documents)
#
# A source only finds documents and splits them; everything after (dropping junk, the tokenizer, the shards, meta.json)
# is prepare_text's, the same for every source, so a new source is one small function.

def split_tail(text, val_percent):
    """Cut text at a line break near (100 - val_percent)% of its length; return (head, tail)."""
    # at a line break, so that val does not open with half a line
    k = len(text) * (100 - val_percent) // 100
    cut = text.rfind("\n", 0, k) + 1 or k
    return text[:cut], text[cut:]

def split_files(named, val_percent):
    """Split (relative path, text) pairs by whole files, each text once: val when crc32(path) % 100 < val_percent."""
    # Whole files, not a random sample of lines: a val file's text is text the model never saw, so val loss
    # measures generalisation, not how well it recalls the neighbours of a line it trained on.
    # Hashing the path, not its place in the list, keeps a file on its side as other files come and go.
    # A file's exact copy under another path (a vendored package, a license, an empty __init__.py) is dropped
    # first: else a copy could land in train and its twin in val, and val loss would reward recall, not
    # generalisation. The first path in the source's order keeps the text.
    seen = set()
    unique = []
    for name, text in named:
        digest = hashlib.sha256(text.encode()).digest()
        if digest not in seen:
            seen.add(digest)
            unique.append((name, text))
    if len(unique) < len(named):
        print(f"dropped {len(named) - len(unique)} file(s) that repeat another file's text")
    named = unique
    val = [zlib.crc32(name.encode()) % 100 < val_percent for name, _ in named]
    if all(val) or not any(val):
        # too few files to split whole: hold out the tail of every file instead
        pieces = [split_tail(text, val_percent) for _, text in named]
        return [h for h, _ in pieces if h], [t for _, t in pieces if t]
    train_docs = []
    val_docs = []
    for (_, text), in_val in zip(named, val):
        if in_val:
            val_docs.append(text)
        else:
            train_docs.append(text)
    return train_docs, val_docs

def junk_reason(doc):
    """Why a document wastes tokens and can set off loss spikes (mostly not text, or a character 1,000+ times)."""
    # Both turn up in any folder of files: a binary blob, a mis-encoded file, a generated table of one character.
    # They teach nothing, and their loss, far below or above the rest, can jolt the optimizer when a batch holds one.
    if len(regex.findall(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]", doc)) > 0.01 * len(doc):
        return "binary or mis-encoded"
    if regex.search(r"(.)\1{999}", doc, regex.S):
        return "a character repeated 1,000+ times"
    return None

def drop_junk(docs, keep):
    """docs without the pathological ones (unless keep), and {reason: count} of those found."""
    reasons = [junk_reason(d) for d in docs]
    kept = [d for d, r in zip(docs, reasons) if keep or r is None]
    return kept, dict(Counter(r for r in reasons if r))

def source_stdlib(args):
    """The running Python's standard library, a document per .py file; installed packages left out."""
    # about 31 MB of Python on any machine that runs this script: a corpus that needs no network, large enough for a
    # small model to learn real structure from, and code, whose loss shows learning plainly (indentation, names)
    root = Path(sysconfig.get_paths()["stdlib"])
    named = []
    for p in sorted(root.rglob("*.py")):
        name = p.relative_to(root).as_posix()
        if not {"site-packages", "dist-packages"} & set(name.split("/")):
            named.append((name, p.read_bytes().decode(errors="replace")))
    return split_files(named, args.val_percent)

def source_text(args):
    """The files named, and all files under the folders named (hidden ones aside), a document per file."""
    named = []
    for arg in map(Path, args.paths):
        if not arg.exists():
            fail(f"{arg} does not exist; give text files or folders of them")
        if arg.is_file():
            files = [(arg.name, arg)]
        else:
            files = []
            for p in sorted(arg.rglob("*")):
                hidden = any(s.startswith(".") for s in p.relative_to(arg).parts)  # e.g. .git
                if p.is_file() and not hidden:
                    files.append((p.relative_to(arg).as_posix(), p))
        for name, p in files:
            data = p.read_bytes()
            # a NUL byte marks a binary file: skip it; other invalid UTF-8 becomes U+FFFD
            if b"\0" not in data:
                named.append((name, data.decode(errors="replace")))
    if not named:
        fail(f"no text files found in {' '.join(args.paths)}; give text files or folders of them")
    return split_files(named, args.val_percent)

def source_shakespeare(args):
    """tinyshakespeare as one document, its last val_percent (10) % of text, cut at a line break, as val."""
    path = Path(args.data_dir) / "input.txt"
    download(SHAKESPEARE_URL, path)
    train, val = split_tail(path.read_text(encoding="utf-8"), args.val_percent)
    return [train], [val]

def prepare_text(args):
    """Read args.source, tokenize both splits into shards, and publish them with meta.json in args.data_dir."""
    t0 = time.time()
    data_dir = Path(args.data_dir)
    if not 0 < args.val_percent < 100 or args.shard_tokens < 1:
        fail("need 0 < --val_percent < 100 and --shard_tokens >= 1")
    train_docs, val_docs = args.source(args)
    keep = args.junk == "keep"
    train_docs, bad = drop_junk(train_docs, keep)
    val_docs, bad_val = drop_junk(val_docs, keep)
    bad = dict(Counter(bad) + Counter(bad_val))
    if bad:
        found = ", ".join(f"{n} {r}" for r, n in bad.items())
        if keep:
            print(f"kept {sum(bad.values())} pathological document(s): {found}")
        else:
            print(f"dropped {sum(bad.values())} pathological document(s): {found} (--junk=keep keeps them)")
    # a fixed random order: training should not walk the sources alphabetically
    random.Random(0).shuffle(train_docs)
    if not any(train_docs) or not any(val_docs):
        utf8 = ""
        if "binary or mis-encoded" in bad:
            utf8 = " (files must be UTF-8: iconv -f latin1 -t utf-8 converts)"
        fail(f"the train or the val split has no text{utf8}; give more text or change --val_percent")
    with staging(data_dir) as stage:  # built beside data_dir, then moved in
        encode, info = make_tokenizer(args.tokenizer, train_docs, stage)
        eot = np.array([info["eot_id"]], np.uint16)
        splits = {}
        for split, docs in (("train", train_docs), ("val", val_docs)):
            # one stream per split, each document opened by EOT: the model learns where documents begin, and a
            # sequence the loader cuts from the stream may span documents, with EOT telling them apart
            parts = []
            for tokens in encode(docs):
                parts += [eot, tokens]
            stream = np.concatenate(parts).astype(np.uint16)  # (tokens,)
            n = args.shard_tokens
            shards = [f"{split}_{i:06d}.bin" for i in range(-(-len(stream) // n))]  # ceil(len / n) of them
            for i, name in enumerate(shards):
                write_shard(stage / name, stream[i * n:(i + 1) * n])
            # the bytes as well as the tokens: a loss in bits per byte compares across tokenizers, where a loss per
            # token does not (a byte token carries one byte, a GPT-2 token about four)
            splits[split] = dict(
                tokens=len(stream),
                bytes=sum(len(d.encode()) for d in docs),
                docs=len(docs),
                shards=shards,
            )
        # the baselines a trained model's val bits per byte should beat: a general-purpose compressor's rate on the
        # same text. A model whose bits per byte are above gzip's has learned less than gzip's 32 KB window finds.
        raw = b"\n".join(d.encode() for d in val_docs)
        meta = dict(
            format="trainsuite-text-1",
            source=args.command,
            tokenizer=args.tokenizer,
            **info,
            splits=splits,
            junk_docs={"found": bad, "action": args.junk},
            val_gzip_bpb=8 * len(gzip.compress(raw, compresslevel=9)) / len(raw),
            val_xz_bpb=8 * len(lzma.compress(raw, preset=9)) / len(raw),
        )
        # from the first unlink until the last move, data_dir is not prepared
        old = [*data_dir.glob("train_*.bin"), *data_dir.glob("val_*.bin"), data_dir / "tokenizer.tiktoken"]
        publish(stage, data_dir, meta, old)
    for split, s in splits.items():
        print(f"{split}: {s['tokens']:,} tokens | {s['bytes']:,} bytes | {s['docs']:,} docs | "
              f"{len(s['shards'])} shard(s)")
    print(f"val bits per byte: gzip -9 {meta['val_gzip_bpb']:.3f} | xz -9 {meta['val_xz_bpb']:.3f}")
    print(f"wrote {data_dir} ({args.tokenizer}, vocab {info['vocab_size']}) in {time.time() - t0:.1f} s")

def prepare_fineweb(args):
    """Download the val shard and the first --shards train shards of GPT-2 tokenized FineWeb-10B; write meta.json."""
    # These shards are already tokenized, in llm.c's format, so they are downloaded as they are into data_dir (each
    # whole or not at all, by download's .part) and only meta.json is written here.
    if not 1 <= args.shards <= 103:
        fail(f"--shards={args.shards}: FineWeb-10B has train shards 1..103")
    data_dir = Path(args.data_dir)
    names = {
        "train": [f"fineweb_train_{i:06d}.bin" for i in range(1, args.shards + 1)],
        "val": ["fineweb_val_000000.bin"],
    }
    for name in names["val"] + names["train"]:
        download(FINEWEB_URL + name, data_dir / name)
    splits = {}
    for s, ns in names.items():
        tokens = sum(num_tokens(data_dir / n) for n in ns)
        splits[s] = dict(tokens=tokens, bytes=None, docs=None, shards=ns)
    val = read_shard(data_dir / names["val"][0])  # (tokens,) uint16
    splits["val"]["docs"] = int((val == 50256).sum())  # every document starts with EOT
    try:
        # val bytes, for bits per byte: each token stands for a fixed byte string
        enc = tiktoken.get_encoding("gpt2")
        lengths = np.array([len(enc.decode_single_token_bytes(t)) for t in range(enc.n_vocab)])  # (vocab,)
        lengths[enc.eot_token] = 0
        splits["val"]["bytes"] = int(lengths[val].sum())
    except Exception as e:
        print(f"val bytes unknown: cannot load tiktoken's gpt2 files ({type(e).__name__}); see TIKTOKEN_CACHE_DIR")
    meta = dict(
        format="trainsuite-text-1",
        source="fineweb",
        tokenizer="gpt2",
        vocab_size=50257,
        eot_id=50256,
        pat_str=None,
        tokenizer_file=None,
        splits=splits,
        val_gzip_bpb=None,  # no text to compress: the shards hold only tokens
        val_xz_bpb=None,
    )
    (data_dir / "meta.json.tmp").write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(data_dir / "meta.json.tmp", data_dir / "meta.json")  # atomic: never a half-written meta.json
    for split, s in splits.items():
        print(f"{split}: {s['tokens']:,} tokens in {len(s['shards'])} shard(s)")

def prepare_gpt2(args):
    """GPT-2's weights from the Hugging Face hub (config.json, model.safetensors), for finetune_gpt.py --init_from."""
    out = Path(args.data_dir or f"models/{args.model}")  # download() makes it
    offline = "--init_from=FOLDER with a Hugging Face GPT-2 folder you have (config.json, model.safetensors)"
    for name in ("config.json", "model.safetensors"):
        download(f"{GPT2_URL}{args.model}/resolve/main/{name}", out / name, instead=offline)
    print(f"{args.model} is in {out}: python finetune_gpt.py --init_from={out} --data_dir=DATA (GPT-2 tokens)")

def prepare_hellaswag(args):
    """HellaSwag's val set (Zellers et al. 2019) for eval_gpt.py: a context and 4 endings a JSON line."""
    path = Path(args.data_dir) / "hellaswag_val.jsonl"
    own = "eval_gpt.py --items=FILE, items of your own (a JSON line each: ctx, endings, label)"
    download(HELLASWAG_URL, path, instead=own)
    items = sum(1 for line in path.open() if line.strip())
    print(f"{items:,} items in {path}: python eval_gpt.py --items={path}")

def prepare_core(args):
    """The DCLM eval bundle (Li et al. 2024) for eval_gpt.py --task=core, in its published layout: core.yaml,
    eval_meta_data.csv and eval_data/, each file checked against the archive's CRC-32 before it is moved in."""
    # The bundle is one zip whose folder eval_bundle/ holds core.yaml (each task's file, kind, few-shot count and
    # delimiter), eval_meta_data.csv (each task's random baseline, in percent) and eval_data/CATEGORY/TASK.jsonl.
    # The zip downloads to data_dir as every download does (resuming, whole or not at all), and its SHA-256 is
    # printed and kept in meta.json; --sha256 makes the command refuse any other bytes. Then every file that
    # core.yaml names must be in it, and each member is read through the zip's own CRC-32, which names a damaged
    # one; only then do the files leave the staging folder.
    import yaml  # PyYAML: core.yaml is the bundle's own file
    data_dir = Path(args.data_dir)
    archive = data_dir / "eval_bundle.zip"
    own = f"an eval_bundle.zip you have, put at {archive}"
    download(CORE_URL, archive, instead=own)
    digest = hashlib.sha256()
    with archive.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    if args.sha256 and sha256 != args.sha256.lower():
        fail(f"{archive}: its SHA-256 is {sha256}, not --sha256={args.sha256}; delete it and run again")
    anew = "delete it and run the same command again to download it anew"
    try:
        bundle = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as e:
        fail(f"{archive}: not a whole zip archive ({e}); {anew}")
    with bundle, staging(data_dir) as stage:
        names = set(bundle.namelist())
        for need in ("core.yaml", "eval_meta_data.csv"):
            if f"eval_bundle/{need}" not in names:
                fail(f"{archive}: no eval_bundle/{need} in it, so it is no DCLM eval bundle; {anew}")
        tasks = {}  # label: the member that holds its items
        try:
            for task in yaml.safe_load(bundle.read("eval_bundle/core.yaml"))["icl_tasks"]:
                tasks[task["label"]] = f"eval_bundle/eval_data/{task['dataset_uri']}"
            rows = csv.DictReader(io.StringIO(bundle.read("eval_bundle/eval_meta_data.csv").decode()))
            baselines = {row["Eval Task"]: row["Random baseline"] for row in rows}
        except (yaml.YAMLError, zipfile.BadZipFile, UnicodeDecodeError, KeyError, TypeError) as e:
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            fail(f"{archive}: its core.yaml or eval_meta_data.csv is not the bundle's ({why}); {anew}")
        for label, member in tasks.items():
            if member not in names:
                fail(f"{archive}: no {member} in it, which core.yaml names for task {label}; {anew}")
            if label not in baselines:
                fail(f"{archive}: eval_meta_data.csv has no random baseline for task {label}; {anew}")
        for member in sorted(names):
            out = stage / member.removeprefix("eval_bundle/")
            # a member's name stays inside the bundle: no absolute path, no "..", nothing outside eval_bundle/
            if member.endswith("/") or not member.startswith("eval_bundle/") or ".." in Path(member).parts:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            try:  # the read checks the member's CRC-32 at its end
                with bundle.open(member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
                fail(f"{archive}: {member} is damaged ({e}); {anew}")
        items = {}
        for label, member in tasks.items():
            with (stage / member.removeprefix("eval_bundle/")).open("rb") as f:
                items[label] = sum(1 for line in f if line.strip())
        meta = dict(format="trainsuite-core-1", source=CORE_URL, sha256=sha256, items=items)
        old = [data_dir / "core.yaml", data_dir / "eval_meta_data.csv", data_dir / "eval_data"]
        publish(stage, data_dir, meta, old)
    archive.unlink()  # its files are in place, and its SHA-256 is in meta.json
    print(f"{len(tasks)} tasks, {sum(items.values()):,} items in {data_dir} (eval_bundle.zip's SHA-256 {sha256}): "
          f"python eval_gpt.py --task=core --items={data_dir}")

# -----------------------------------------------------------------------------
# Images: a source returns ({"train": (images, labels), "val": (images, labels)}, class names)
#
# Images are stored decoded, as one uint8 array per split: 50,000 CIFAR images are 150 MB, which a trainer loads
# into memory once and never decodes again, where a folder of PNGs would be decoded again every epoch, on the CPU
# that also feeds the GPU. Labels are int64, the class indices that torch's cross_entropy takes.

SHAPES = ("circle", "ring", "triangle", "square", "hexagon", "star", "cross", "crescent", "heart", "arrow")
# --rotate=off: the angle of each shape upright, in units of pi
UPRIGHT = (0, 0, 1.5, 0.25, 0, 1.5, 0, 0, 1, 0)
CORNERS = {"triangle": 3, "square": 4, "hexagon": 6}

def shape_mask(k, u, v):
    """Inside shape k at shape coordinates u, v (the shape spans about [-1, 1]); arrays broadcast."""
    name = SHAPES[k]
    # the polar coordinates, only for the shapes that use them (arctan2 is slow)
    if name in ("circle", "ring", "crescent", "star") or name in CORNERS:
        r = np.hypot(u, v)
    if name == "star" or name in CORNERS:
        th = np.arctan2(v, u)
    if name == "circle":
        return r < 0.9
    if name == "ring":
        return (r < 1) & (r > 0.55)
    if name in CORNERS:
        # a regular n-gon with its corners on the unit circle: fold the angle into one side's sector; a point is
        # inside if its distance along that side's normal is under the side's, cos(pi / n)
        n = CORNERS[name]
        return r * np.cos(np.mod(th, 2 * np.pi / n) - np.pi / n) < np.cos(np.pi / n)
    if name == "star":
        return r < 0.42 + 0.58 * np.abs(np.cos(2.5 * th)) ** 2  # five points
    if name == "cross":
        vertical = (abs(u) < 0.3) & (abs(v) < 1)
        horizontal = (abs(v) < 0.3) & (abs(u) < 1)
        return vertical | horizontal
    if name == "crescent":
        return (r < 1) & (np.hypot(u - 0.5, v) > 0.8)  # a disc less a smaller one shifted right
    if name == "heart":
        # the heart curve (x^2 + y^2 - 1)^3 = x^2 y^3, scaled and moved to fill [-1, 1]
        x = 1.2 * u
        y = 1.2 * v + 0.2
        return (x * x + y * y - 1) ** 3 - x * x * y ** 3 < 0
    # the arrow: a shaft along u, then a triangular head pointing to +u
    shaft = (abs(v) < 0.22) & (u > -1) & (u < 0.1)
    head = (u >= 0.1) & (u < 1) & (abs(v) < 0.8 * (1 - u) / 0.9)
    return shaft | head

def make_shapes(n, size, seed, rotate=True, pool=None, chunk=256):
    """n images (n, size, size, 3) uint8 of one of 10 shapes each, and their labels (n,) int64; the same for the same
    seed. A bright shape of random colour, size, position and rotation (or upright) on a dark gradient background with
    clutter lines and blobs: neither colour nor position gives the class away, so a linear classifier does poorly."""
    # A dataset that needs no download and that a small ViT must learn shapes to solve: every cue but the outline
    # (colour, size, place, angle, background, clutter) is random. Each chunk of `chunk` images has a generator of
    # its own, seeded by (seed, the chunk's index), and draws from it in a fixed order: the same seed gives the same
    # images, bit for bit, whether the chunks are drawn here or side by side by a pool's processes.
    jobs = [(seed, index, min(chunk, n - i), size, rotate) for index, i in enumerate(range(0, n, chunk))]
    parts = list(in_order(pool, draw_shapes, jobs, len(jobs), first=lambda i: f"image {i * chunk:,}"))
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])

def draw_shapes(seed, index, m, size, rotate):
    """Chunk `index` of make_shapes: m images (m, size, size, 3) uint8 and their labels (m,) int64."""
    # m is at most make_shapes' chunk, so the float32 work arrays, (m, 2 size, 2 size, 3), stay small whatever n is
    rng = np.random.default_rng((seed, index))
    labels = rng.integers(0, len(SHAPES), m)  # (m,)
    ss = 2  # 2x2 supersampling: anti-aliased edges
    g = (np.arange(size * ss) + 0.5) / (size * ss) * 2 - 1  # pixel centres in [-1, 1]
    g = g.astype(np.float32)
    Y, X = np.meshgrid(g, g, indexing="ij")  # (size * ss, size * ss) each

    def par(*shape):
        """m uniform numbers in [0, 1) for each of shape, as (m, 1, 1, *shape): they broadcast over Y, X."""
        return rng.random((m, *shape), np.float32)[:, None, None]

    # the background: a dark gradient between two random colours, at a random angle
    ang = 2 * np.pi * par()
    base = par(3)
    top = par(3)
    bottom = par(3)
    ramp = (np.cos(ang) * X + np.sin(ang) * Y + 1) / 2  # (m, H, W) in [0, 1]
    img = 0.45 * (base + (top - bottom) * ramp[..., None])  # (m, H, W, 3)
    # Each thing drawn on top (lines, blobs, the shape) paints its number into layer, where it covers the
    # background, and its colour into paint; each pixel takes the colour of the last thing that covers it,
    # in one pass at the end rather than a pass over the whole image for each thing.
    layer = np.zeros((m, *X.shape), np.uint8)  # 0: the background shows
    paint = []  # (m, 3) a colour per image for each thing drawn
    for j in range(2):
        # up to 2 thin lines across the image, half-transparent
        a = np.pi * par()
        off = 2 * par() - 1
        w = 0.015 + 0.025 * par()
        on = par() < (0.8, 0.4)[j]
        line = (np.abs(np.cos(a) * X + np.sin(a) * Y - off) < w) & on
        paint.append(0.6 * par(3))
        layer[line] = len(paint)
    for _ in range(2):  # up to 2 small blobs
        cx = 2 * par() - 1
        cy = 2 * par() - 1
        rr = 0.04 + 0.08 * par()
        on = par() < 0.5
        blob = (np.hypot(X - cx, Y - cy) < rr) & on
        paint.append(0.6 * par(3))
        layer[blob] = len(paint)
    # the shape: a scale s, a centre that keeps it inside the image, and an angle
    s = 0.45 + 0.35 * par()
    cx = (2 * par() - 1) * (1 - s)
    cy = (2 * par() - 1) * (1 - s)
    if rotate:
        rot = 2 * np.pi * par()
    else:
        rot = np.pi * np.array(UPRIGHT, np.float32)[labels, None, None]
    # the pixels in shape coordinates: moved to the centre, scaled, rotated
    xr = (X - cx) / s
    yr = (Y - cy) / s
    u = np.cos(rot) * xr + np.sin(rot) * yr
    v = np.cos(rot) * yr - np.sin(rot) * xr
    mask = np.zeros((m, *X.shape), bool)
    for k in range(len(SHAPES)):
        sel = labels == k
        mask[sel] = shape_mask(k, u[sel], v[sel])
    paint.append(0.55 + 0.45 * par(3))  # a bright shape on a dark background
    layer[mask] = len(paint)
    # each covered pixel takes the colour, in its own image, of the last thing drawn over it
    covered = layer > 0  # (m, H, W)
    image_of = np.nonzero(covered)[0]  # the image each covered pixel is in
    colours = np.stack(paint, axis=1).reshape(m, len(paint), 3)
    img[covered] = colours[image_of, layer[covered] - 1]
    img += 0.02 * rng.standard_normal(img.shape, np.float32)  # a little noise: no pixel is exactly clean
    # average each 2x2 block: (m, size, size, 3); four adds give mean((2, 4))'s bytes at 3x its speed
    q = img.reshape(m, size, ss, size, ss, 3)
    img = (q[:, :, 0, :, 0] + q[:, :, 0, :, 1] + q[:, :, 1, :, 0] + q[:, :, 1, :, 1]) / 4
    return np.clip(img * 255 + 0.5, 0, 255).astype(np.uint8), labels.astype(np.int64)

def source_shapes(args):
    """The procedural shapes dataset: train and val from different seeds (no network)."""
    if args.image_size < 8 or args.train_size < 1 or args.val_size < 1 or args.workers < 0:
        fail("need --image_size >= 8, --train_size >= 1, --val_size >= 1 and --workers >= 0")
    splits = {}
    sizes = {"train": (args.train_size, args.seed), "val": (args.val_size, args.seed + 1)}
    with worker_pool(args.workers) as pool:  # the chunks drawn side by side, one process a CPU
        for split, (n, seed) in sizes.items():
            splits[split] = make_shapes(n, args.image_size, seed, rotate=args.rotate == "on", pool=pool)
            print(f"{split}: {n:,} images generated")
    return splits, list(SHAPES)

OFFLINE_IMAGES = "'python prepare_data.py shapes' or 'python prepare_data.py imagefolder PATH'"
FASHION_CLASSES = "T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot".split(",")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

@contextlib.contextmanager
def reading(path):
    """Turn the errors of reading a damaged, truncated or wrong file into a one-line fail() that says what to do."""
    try:
        yield
    except (EOFError, OSError, zlib.error, tarfile.TarError, pickle.UnpicklingError,
            KeyError, TypeError, ValueError) as e:
        fail(f"{path} is damaged or not the expected file ({type(e).__name__}: {' '.join(str(e).split())}); "
             "delete it and run the same command again")

class CifarUnpickler(pickle.Unpickler):
    """CIFAR's batches are pickles (their official format, written by Python 2 and numpy 1) that hold only dicts,
    lists, bytes, ints and uint8 arrays. Unpickling runs whatever code a file names, so this one builds numpy arrays
    and refuses everything else. Load with encoding="bytes": Python 2 strings stay bytes, as in every CIFAR loader."""

    def find_class(self, module, name):
        """The class a pickle names, if it is one that a numpy array needs; refused otherwise."""
        # numpy's _reconstruct, in numpy.core (1.x) or numpy._core (2.x)
        reconstruct = np.zeros(0).__reduce__()[0]
        allowed = {
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            ("numpy.core.multiarray", "_reconstruct"): reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        }
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"a pickle in it asks for {module}.{name}, which no CIFAR file holds: refused")
        return allowed[module, name]

def source_cifar(args):
    """CIFAR-10 or CIFAR-100 from the official python-format .tar.gz, read in place: nothing is extracted to disk."""
    if args.command == "cifar10":
        url = CIFAR10_URL
        meta_file = "batches.meta"
        prefix = ""
        files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}
    else:
        url = CIFAR100_URL
        meta_file = "meta"
        prefix = f"{args.labels}_"  # CIFAR-100: fine_ or coarse_
        files = {"train": ["train"], "val": ["test"]}
    path = Path(args.data_dir) / url.rsplit("/", 1)[1]
    download(url, path, OFFLINE_IMAGES)
    labels = f"{prefix}labels".encode()
    names = f"{prefix}label_names".encode()
    with reading(path), tarfile.open(path, "r:gz") as tar:
        # one pass over the gzip stream (a .tar.gz has no index to seek in), then on to its end, where gzip checks
        # its CRC: a flipped bit fails here, not as wrong pixels
        raw = {Path(m.name).name: tar.extractfile(m).read() for m in tar if m.isfile()}
        tar.fileobj.read()
        batches = {}
        for n in [meta_file, *files["train"], *files["val"]]:
            batches[n] = CifarUnpickler(io.BytesIO(raw[n]), encoding="bytes").load()
        classes = [c.decode() for c in batches[meta_file][names]]
        splits = {}
        for s, ns in files.items():
            # a row holds 1024 R, then 1024 G, then 1024 B values, each plane 32x32 row-major
            x = np.concatenate([np.asarray(batches[n][b"data"], np.uint8).reshape(-1, 3, 32, 32) for n in ns])
            y = np.concatenate([np.asarray(batches[n][labels], "int64") for n in ns])  # (N,)
            splits[s] = x.transpose(0, 2, 3, 1), y  # (N, 3, 32, 32) -> (N, 32, 32, 3): channels last, as stored
    return splits, classes

def read_idx(path, magic, ndim):
    """A gzipped IDX file: big-endian int32 magic and ndim sizes, then their product of uint8 values."""
    # LeCun's IDX format: the magic's third byte is the value type (0x08, uint8) and its fourth the number of
    # dimensions, so images are 0x0803 = 2051 (N, 28, 28) and labels 0x0801 = 2049 (N,)
    with reading(path):
        data = gzip.decompress(path.read_bytes())
    head = 4 * (ndim + 1)
    dims = [None]
    if len(data) >= head:
        dims = np.frombuffer(data[:head], ">i4").tolist()
    if (dims[0] != magic
            or min(dims[1:]) < 0
            or len(data) != head + math.prod(dims[1:])):
        fail(f"{path} is not an IDX file of magic {magic} and the size its header gives (damaged or truncated?); "
             "delete it and run the same command again")
    return np.frombuffer(data, np.uint8, offset=head).reshape(dims[1:])

def source_idx(args):
    """MNIST or Fashion-MNIST from their four gzipped IDX files: 28x28 grayscale, 60,000 train and 10,000 val."""
    mnist = args.command == "mnist"
    url = MNIST_URL if mnist else FASHION_MNIST_URL
    data_dir = Path(args.data_dir)
    for name in [*IDX_FILES["train"], *IDX_FILES["val"]]:
        download(url + name, data_dir / name, OFFLINE_IMAGES)
    splits = {}
    for s, (images, labels) in IDX_FILES.items():
        x = read_idx(data_dir / images, 2051, 3)[..., None]  # (N, 28, 28, 1): one channel
        y = read_idx(data_dir / labels, 2049, 1).astype("int64")  # (N,)
        splits[s] = x, y
    if mnist:
        return splits, [str(d) for d in range(10)]
    return splits, list(FASHION_CLASSES)

def image_classes(root):
    """The class folders of an ImageFolder-style root (root/CLASS/**/*.png etc.), sorted, hidden ones left out."""
    if not root.is_dir():
        fail(f"{root} does not exist or is not a folder; give a folder with a subfolder of images per class "
             "(PATH/CLASS/*.png)")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(classes) < 2:  # one class: any classifier scores 100%
        fail(f"{root} has {len(classes)} class subfolders; a classifier needs 2 or more, one folder of images "
             "each (PATH/CLASS/*.png)")
    return classes

def list_images(root, c):
    """The sorted image paths of class folder c of root (root/c/**/*.png etc.), relative to root, hidden entries
    left out."""
    found = []
    for p in sorted((root / c).rglob("*")):
        rel = p.relative_to(root)
        hidden = any(s.startswith(".") for s in rel.parts)
        if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file() and not hidden:
            found.append(rel)
    if not found:
        fail(f"class folder {root / c} holds no images ({', '.join(IMAGE_EXTENSIONS)}); add some or remove the "
             "folder")
    return found

def path_bytes(paths):
    """(N,) array of dtype S: each path as os.fsencode's bytes, as long as the longest (os.fsdecode reads it back)."""
    return np.array([os.fsencode(p) for p in paths], "S")

class BadImage(Exception):
    """An image that Pillow cannot read; its message is the command's one-line error."""

def load_images(root, paths, size):
    """(uint8 (N, size, size, 3), all grayscale?) of the images at `paths`, bytes relative to root (a chunk of a
    split's array): RGB, the centre square resized (torchvision's Resize+CenterCrop). The task a decoding worker
    runs."""
    from PIL import Image, ImageOps  # source_imagefolder has checked that Pillow is installed
    out = np.empty((len(paths), size, size, 3), np.uint8)
    gray = True
    for i, rel in enumerate(paths):
        p = root / os.fsdecode(rel)  # the path as list_images found it: an error names it as text
        try:  # UnidentifiedImageError is an OSError
            with Image.open(p) as im:
                gray &= im.mode in ("1", "L", "LA")
                # the centre square, resized: the aspect ratio kept and the long side cropped, as torchvision's
                # Resize + CenterCrop does, and as predict_vit.py reads an image to classify
                square = ImageOps.fit(im.convert("RGB"), (size, size), Image.Resampling.BILINEAR)
                out[i] = np.asarray(square)  # (size, size, 3)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            # raised, not fail(): in a worker, SystemExit would end the process and leave the pool waiting for it.
            # The pool sends the exception back to the main process, which stops with its message.
            raise BadImage(f"cannot read the image {p} ({type(e).__name__}: {e}); delete or fix it") from None
    return out, gray

def source_imagefolder(args):
    """({split: (root, paths, labels)}, classes) of PATH/CLASS/*.png (ImageFolder's layout): a split's image paths,
    relative to its root, as one (N,) array of bytes (path_bytes), and their labels (N,) int64; val: --val=PATH, or
    --val_fraction by path hash. The images are read later, a chunk at a time, by write_imagefolder."""
    root = Path(args.path)
    if args.image_size < 1 or args.workers < 0 or not 0 < args.val_fraction < 1:
        fail("need --image_size >= 1, --workers >= 0 and 0 < --val_fraction < 1")
    try:  # only this command needs Pillow
        import PIL  # noqa: F401
    except ImportError:
        fail("imagefolder needs Pillow: pip install Pillow")
    classes = image_classes(root)
    # The pixels are streamed in 2 MiB chunks, so the list of paths is what grows with the folder. A Path object keeps
    # its parts as a list of strings, and with a (path, label) tuple it takes about 470 bytes an image: 600 MB for
    # ImageNet's 1.28M files. A path relative to its root, as bytes in one array a split, takes tens (ImageNet's are
    # 30, as "n01440764/n01440764_10026.JPEG": 50 MB with the labels, twice that while the classes are joined), and
    # a class's Path objects live only while that class is listed.
    parts = {"train": [], "val": []}  # {split: [(paths, labels) of each class]}
    for k, c in enumerate(classes):
        rel = list_images(root, c)
        paths = path_bytes(rel)
        labels = np.full(len(paths), k, np.int64)
        if args.val:
            parts["train"].append((paths, labels))
            continue
        # hashing the path, not its place in the list, keeps an image on its side as others come and go; the
        # highest hash stays in train, so that every class has a train image
        h = np.array([zlib.crc32(r.as_posix().encode()) for r in rel]) / 2**32  # (N,) in [0, 1)
        val = (h < args.val_fraction) & (h < h.max())
        parts["train"].append((paths[~val], labels[~val]))
        parts["val"].append((paths[val], labels[val]))
    roots = {"train": root, "val": root}
    # a val folder of its own (a benchmark's fixed split) is kept as it is; otherwise val is drawn from train
    if args.val:
        roots["val"] = Path(args.val)
        val = {c: path_bytes(list_images(roots["val"], c)) for c in image_classes(roots["val"])}
        if unknown := sorted(set(val) - set(classes)):
            fail(f"{args.val} has class folder(s) {', '.join(unknown)} that {root} lacks; a val class must also be a "
                 "train class")
        for c, paths in val.items():
            parts["val"].append((paths, np.full(len(paths), classes.index(c), np.int64)))
    elif not sum(len(paths) for paths, _ in parts["val"]):
        fail(f"no image of {root} fell into val at --val_fraction={args.val_fraction}; raise it or give --val=PATH")
    items = {}
    for s, pairs in parts.items():
        items[s] = roots[s], np.concatenate([p for p, _ in pairs]), np.concatenate([y for _, y in pairs])
    return items, classes

# Arrays too large for memory are written and read a chunk of about 2 MiB at a time: 170 images of 64x64x3, 13 of
# 224x224x3. ImageNet's 1.28M train images at 224x224 are 193 GB as uint8, more than a host holds; in chunks, the
# pixels held in memory at once are as few for it as for a folder of 100 images.
CHUNK_BYTES = 2 * 2**20

def images_per_chunk(image_shape):
    """How many images of shape (H, W, C) make a chunk of about CHUNK_BYTES (at least one)."""
    return max(1, CHUNK_BYTES // math.prod(image_shape))

def new_npy(path, shape):
    """Create path as a uint8 .npy file of `shape`, its pixels zeros; return the byte offset where they start."""
    # numpy writes the header and sizes the file (sparse: no zeros are written), and the map is closed at once. It
    # is not kept open to be filled: each page written through a map counts in this process's resident memory (its
    # RSS) while the map is open, so filling a 193 GB map would count up to 193 GB against the process. Plain file
    # writes go to the OS's page cache instead, which is no process's memory and which the OS writes out and frees.
    m = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    offset = m.offset
    del m
    return offset

def npy_shape(path):
    """The shape of the array in a .npy file, read from its header."""
    return np.load(path, mmap_mode="r").shape

def read_rows(path, start, stop, step=1):
    """A copy of images start:stop:step of a .npy file, read through a read-only map that is closed on return."""
    # the pages read through a map count in this process's RSS for as long as the map is open: a map of the whole
    # file, held while every chunk is read, would grow to the file's size. One map per chunk gives them back.
    x = np.load(path, mmap_mode="r")
    return np.array(x[start:stop:step])

def pixel_stats(path, every):
    """Per-channel mean and std, in [0, 1] and rounded to 4 places, of the pixels of every `every`-th image of a
    uint8 (N, H, W, C) .npy file, read a chunk at a time."""
    n, h, w, c = npy_shape(path)
    per_chunk = images_per_chunk((h, w, c))
    # hist[ch, v]: how many sampled pixels of channel ch have the value v. It takes a chunk at a time, where a
    # float64 copy of the sample would take 8 bytes a pixel (12 GB for 10,000 images of 224x224x3)
    hist = np.zeros((c, 256), np.int64)
    for start in range(0, n, every * per_chunk):
        x = read_rows(path, start, start + every * per_chunk, every)  # (per_chunk, H, W, C)
        for ch in range(c):
            hist[ch] += np.bincount(x[..., ch].ravel(), minlength=256)
    values = np.arange(256) / 255  # a pixel's value in [0, 1]
    total = hist.sum(1)  # (C,) pixels sampled
    mean = hist @ values / total
    # the variance in two passes, as numpy's std computes it: never below zero, and accurate when it is small
    var = (hist * (values - mean[:, None]) ** 2).sum(1) / total
    return mean.round(4).tolist(), np.sqrt(var).round(4).tolist()

def image_meta(stage, splits, classes, source, flip_ok):
    """meta.json of the image arrays staged in `stage`, one pair of files for each name in `splits`."""
    train = stage / "train_images.npy"
    n, h, w, c = npy_shape(train)
    # The trainers normalise each channel by the train pixels' mean and std; about 10,000 images estimate them to
    # a few decimals, so a large set is sampled (every k-th image) rather than read whole
    mean, std = pixel_stats(train, every=max(1, n // 10000))
    counts = {}
    for s in splits:
        counts[s] = {"images": npy_shape(stage / f"{s}_images.npy")[0]}
    return dict(
        format="trainsuite-image-1",
        source=source,
        classes=list(classes),
        num_classes=len(classes),
        image_size=[h, w],
        channels=c,
        mean=mean,
        std=std,
        splits=counts,
        flip_ok=bool(flip_ok),
    )

def write_images(data_dir, splits, classes, source, flip_ok=True):
    """Publish {split: (uint8 images (N, H, W, C), labels (N,))} as split_images.npy, split_labels.npy and meta.json
    (written last: a dir without meta.json is not prepared), from a hidden staging dir; returns the meta dict.
    flip_ok: whether a mirror image is still a sample of its class; the trainers flip only then."""
    data_dir = Path(data_dir)
    shapes = {x.shape[1:] for x, _ in splits.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        fail(f"images of the splits differ in size or are not (N, H, W, C): {sorted(shapes)}; use --image_size")
    for split, (x, y) in splits.items():
        if len(x) != len(y) or not len(x):
            fail(f"{split}: {len(x)} images but {len(y)} labels; the dataset files do not match")
        if y.min() < 0 or y.max() >= len(classes):
            fail(f"{split}: a label is outside 0..{len(classes) - 1}; the dataset files do not match")
    with staging(data_dir) as stage:
        for split, (x, y) in splits.items():
            np.save(stage / f"{split}_images.npy", np.ascontiguousarray(x, dtype=np.uint8))
            np.save(stage / f"{split}_labels.npy", np.asarray(y, dtype=np.int64))
        meta = image_meta(stage, list(splits), classes, source, flip_ok)
        publish(stage, data_dir, meta)
    return meta

# -----------------------------------------------------------------------------
# imagefolder, streamed: each split is decoded by worker processes and written to its staged file a chunk at a time

def quiet_worker():
    """Run by each worker of a pool as it starts: Ctrl-C is for the main process (which stops the pool), and a
    SIGTERM (a scheduler's stop of the whole job) ends a worker at once, not as the KeyboardInterrupt that main()
    makes of it (a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

def usable_cpus():
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1

@contextlib.contextmanager
def worker_pool(workers):
    """A pool of `workers` processes that decode or draw images, or None (work in this process) for workers <= 1."""
    if workers <= 1:
        yield None
        return
    # concurrent.futures, not multiprocessing.Pool: a Pool replaces a worker killed from outside (SIGKILL, the OOM
    # killer's signal) and waits for the dead one's result for ever, while this pool breaks, and says so
    pool = ProcessPoolExecutor(workers, initializer=quiet_worker)
    try:
        yield pool
    finally:
        # after a bad image, Ctrl-C or a failed write: the queued chunks are dropped, and the workers finish the
        # ones they hold (2 MiB each) and exit
        pool.shutdown(cancel_futures=True)

def in_order(pool, work, jobs, window, first):
    """work(*job) of each job, in order: in this process if pool is None, else by the pool, with at most `window`
    jobs in flight (queued, at work, or done and waiting to be taken). first(i) names job i's first image, for errors:
    a function, so that a name is made only when an error needs it."""
    if pool is None:
        for job in jobs:
            yield work(*job)
        return
    # Pool.imap would queue every chunk at once and keep each result until it is taken, so a slow disk would let
    # decoded chunks pile up in memory; here a new chunk is sent only when the oldest is taken
    pending = deque()
    taken = 0  # jobs whose results were taken; those from here on are in flight
    try:
        for job in jobs:
            pending.append(pool.submit(work, *job))
            if len(pending) == window:
                yield pending.popleft().result()  # a worker's exception (BadImage) is raised here
                taken += 1
        while pending:
            yield pending.popleft().result()
            taken += 1
    except BrokenProcessPool:
        # A worker died without a word: killed from outside, since its own errors come back as exceptions. The pool
        # cannot tell which job it held, so the error names those in flight (or next): one of them was its.
        last = min(taken + len(pending) + 1, len(jobs))
        where = f"chunks {taken + 1}-{last}"
        if last == taken + 1:
            where = f"chunk {last}"
        fail(f"a worker process was killed from outside with {where} of {len(jobs)} under way (the first starts "
             f"at {first(taken)}), most likely by the kernel's OOM killer: memory ran out; run this again with fewer "
             f"--workers, or with more memory free")

def write_split(stage, split, root, paths, labels, size, pool, window):
    """Decode a split's images (paths: source_imagefolder's bytes, relative to root) into stage/{split}_images.npy, a
    chunk at a time in the file's order, and write its labels; show progress; return whether every image was
    grayscale."""
    # 8 bytes an image (10 MB for ImageNet's train split): the labels are written at once
    np.save(stage / f"{split}_labels.npy", labels)
    path = stage / f"{split}_images.npy"
    offset = new_npy(path, (len(paths), size, size, 3))
    per_chunk = images_per_chunk((size, size, 3))
    # a chunk is a view of the array, not a copy; a worker is sent its own chunk's bytes and no more
    jobs = [(root, paths[i:i + per_chunk], size) for i in range(0, len(paths), per_chunk)]

    def first(i):
        """The path of chunk i's first image, which the error of a killed worker names."""
        return root / os.fsdecode(paths[i * per_chunk])

    gray = True
    done = 0
    shown = 0.0
    with open(path, "r+b") as f:
        f.seek(offset)
        try:
            for x, chunk_gray in in_order(pool, load_images, jobs, window, first):
                f.write(x)  # (n, size, size, 3): the next n images, appended in place
                gray = gray and chunk_gray
                done += len(x)
                if time.time() - shown > 0.5 or done == len(paths):
                    shown = time.time()
                    print(f"\r{split}: {done:,}/{len(paths):,} images", end="", file=sys.stderr)
        except BadImage as e:
            fail(str(e))
        finally:
            if done:
                # end the progress line, so that what follows (an error or Ctrl-C's message too) has a line of its own
                print(file=sys.stderr)
    return gray

def keep_one_channel(path):
    """Rewrite a staged uint8 (N, H, W, 3) .npy file as (N, H, W, 1), its first channel, a chunk at a time."""
    n, h, w, _ = npy_shape(path)
    per_chunk = images_per_chunk((h, w, 3))
    one = path.with_name(f"one_channel_{path.name}")
    offset = new_npy(one, (n, h, w, 1))
    with open(one, "r+b") as f:
        f.seek(offset)
        for start in range(0, n, per_chunk):
            x = read_rows(path, start, start + per_chunk)
            f.write(np.ascontiguousarray(x[..., :1]))
    os.replace(one, path)

def write_imagefolder(args, flip_ok):
    """Publish args.path's images as write_images does, but decoded straight into the staged files, never a whole
    split in memory; return the meta dict."""
    items, classes = source_imagefolder(args)
    data_dir = Path(args.data_dir)
    size = args.image_size
    # no more workers than the largest split has chunks: a split of one chunk is decoded in this process, since a
    # pool's start would cost more than it saves
    most = max(len(paths) for _, paths, _ in items.values())
    workers = min(args.workers, math.ceil(most / images_per_chunk((size, size, 3))))
    gray = True
    with staging(data_dir) as stage:
        with worker_pool(workers) as pool:
            for split, (root, paths, labels) in items.items():
                # two chunks a worker: each has its next chunk queued while the main process writes the oldest
                split_gray = write_split(stage, split, root, paths, labels, size, pool, window=2 * workers)
                gray = gray and split_gray
        if gray:
            # every image is grayscale: keep one channel (L -> RGB copied it into all three)
            for split in items:
                keep_one_channel(stage / f"{split}_images.npy")
        meta = image_meta(stage, list(items), classes, "imagefolder", flip_ok)
        publish(stage, data_dir, meta)
    return meta

# Is a mirror image still a sample of its class? Yes for shapes, photos and clothes; no for digits (a mirrored 2 is not
# a 2), upright shapes (one pose per class) and, unless --flip_ok, your own folders (letters, text: any handedness)
FLIP_OK = {"shapes": True, "cifar10": True, "cifar100": True, "fashion_mnist": True, "mnist": False}

def prepare_images(args):
    """Read args.source and write its splits as .npy arrays and meta.json in args.data_dir."""
    t0 = time.time()
    flip_ok = FLIP_OK.get(args.command, getattr(args, "flip_ok", False))
    if getattr(args, "rotate", "on") != "on":
        # upright shapes: a mirrored arrow points the other way
        flip_ok = False
    if args.command == "imagefolder":
        # a folder of images may be larger than memory: it is written a chunk at a time
        meta = write_imagefolder(args, flip_ok)
    else:
        splits, classes = args.source(args)
        meta = write_images(args.data_dir, splits, classes, args.command, flip_ok)
    h, w = meta["image_size"]
    counts = ", ".join(f"{s} {n['images']:,}" for s, n in meta["splits"].items())
    print(f"wrote {args.data_dir}: {counts} images of {h}x{w}x{meta['channels']}, {meta['num_classes']} classes, "
          f"in {time.time() - t0:.1f} s")
    if flip_ok:
        will = "flip the training images"
    else:
        will = "not flip them (a mirror image is not taken for its class)"
    if not flip_ok and args.command == "imagefolder":
        will += "; pass --flip_ok if a mirror image is still its class (photos, most objects)"
    print(f"flip_ok {str(flip_ok).lower()} in meta.json: the trainers' --flip=auto will {will}")

# -----------------------------------------------------------------------------
# Entry point

class Parser(argparse.ArgumentParser):
    """argparse with prepare_data.py's one-line errors."""

    def error(self, message):
        """One line, as every script of the suite fails; argparse's own prints the usage over several lines."""
        fail(f"{message} (see python {self.prog} -h)")

def check_flags(unknown, command, parser):
    """Stop at arguments that the subcommand's parser does not take, naming the flag nearest the first as the
    trainers do: a typo such as --data-dir must say which flag it missed, not only that it was not taken."""
    names = [s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--")]
    typed = unknown[0].split("=")[0].lstrip("-")
    near = difflib.get_close_matches(typed, names, n=1)  # every flag has the "--"
    if near:
        fix = f"did you mean --{near[0]}?"
    else:
        fix = f"see python prepare_data.py {command} -h"
    fail(f"unrecognized arguments: {' '.join(unknown)}; {fix}")

def main(argv=None):
    """Parse the command line (sys.argv when argv is None) and run the subcommand; return 0."""
    parser = Parser(
        prog="prepare_data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    # Each subcommand's defaults name what runs it: run(args) prepares, and source(args) reads the data it prepares
    def command(name, help, **defaults):
        """A subcommand's parser. allow_abbrev=False: a typo such as --shard=5 must fail, not be --shard_tokens=5."""
        p = commands.add_parser(name, help=help, allow_abbrev=False)
        p.set_defaults(**defaults)
        return p

    text_sources = [
        ("stdlib", source_stdlib, "Python's standard library .py files (no network)"),
        ("text", source_text, "your own text files and folders"),
        ("shakespeare", source_shakespeare, "tinyshakespeare (downloads 1.1 MB)"),
    ]
    for name, source, help in text_sources:
        p = command(name, help, run=prepare_text, source=source)
        if name == "text":
            p.add_argument("paths", nargs="+", metavar="PATH")
        p.add_argument("--data_dir", default=f"data/{name}",
                       help="where the shards and meta.json go (default: %(default)s)")
        p.add_argument("--tokenizer", type=tokenizer_spec, default="byte",
                       help="byte | gpt2 | bpe:N (N tokens in all)")
        # one play is one document: its last 10% is the val split; the other sources hold out 1% of their files
        val_percent = 1
        if name == "shakespeare":
            val_percent = 10
        p.add_argument("--val_percent", type=int, default=val_percent,
                       help="percent held out for val: files by path hash, or each file's tail if too few files")
        p.add_argument("--shard_tokens", type=int, default=100_000_000,
                       help="tokens per shard at most")
        p.add_argument("--junk", choices=("drop", "keep"), default="drop",
                       help="binary or repetitive documents")

    p = command("fineweb", "GPT-2 tokenized FineWeb-10B (downloads 200 MB a shard)", run=prepare_fineweb)
    p.add_argument("--shards", type=int, required=True,
                   help="train shards of 100M tokens, 1..103")
    p.add_argument("--data_dir", default="data/fineweb10B",
                   help="where the shards go (default: %(default)s)")

    p = command("gpt2", "GPT-2's weights, for finetune_gpt.py --init_from (downloads 0.5-6 GB)", run=prepare_gpt2)
    p.add_argument("--model", choices=("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"), default="gpt2",
                   help="which GPT-2: 124M, 350M, 774M or 1.5B parameters (default: %(default)s)")
    p.add_argument("--data_dir", default="",
                   help="where the weights go (default: models/MODEL)")

    p = command("hellaswag", "HellaSwag's val set, for eval_gpt.py (downloads 11 MB)", run=prepare_hellaswag)
    p.add_argument("--data_dir", default="data/hellaswag",
                   help="where the val items go (default: %(default)s)")

    p = command("core", "the DCLM eval bundle: CORE's 22 tasks, for eval_gpt.py --task=core", run=prepare_core)
    p.add_argument("--data_dir", default="data/core",
                   help="where core.yaml, eval_meta_data.csv and eval_data/ go (default: %(default)s)")
    p.add_argument("--sha256", default="",
                   help="refuse a bundle whose SHA-256 differs (default: any; the command prints it)")

    p = command("shapes", "procedural images of 10 shapes (no network)", run=prepare_images, source=source_shapes)
    p.add_argument("--data_dir", default="data/shapes",
                   help="where the images and meta.json go (default: %(default)s)")
    p.add_argument("--image_size", type=int, default=32,
                   help="height and width in pixels")
    p.add_argument("--train_size", type=int, default=50000,
                   help="train images")
    p.add_argument("--val_size", type=int, default=10000,
                   help="val images")
    p.add_argument("--seed", type=int, default=0,
                   help="train uses seed, val seed + 1")
    p.add_argument("--rotate", choices=("on", "off"), default="on",
                   help="random angles, or upright (diffusion's data)")
    p.add_argument("--workers", type=int, default=usable_cpus(),
                   help="processes that draw images (default: the CPUs this process may run on); 0 or 1: in this one")

    downloaded_images = [
        ("cifar10", source_cifar, "CIFAR-10 (downloads 170 MB)"),
        ("cifar100", source_cifar, "CIFAR-100 (downloads 169 MB)"),
        ("mnist", source_idx, "MNIST (downloads 12 MB)"),
        ("fashion_mnist", source_idx, "Fashion-MNIST (downloads 31 MB)"),
    ]
    for name, source, help in downloaded_images:
        p = command(name, help, run=prepare_images, source=source)
        p.add_argument("--data_dir", default=f"data/{name}",
                       help="where the download is kept and the arrays written")
        if name == "cifar100":
            p.add_argument("--labels", choices=("fine", "coarse"), default="fine",
                           help="100 fine or 20 coarse classes")

    # no source: prepare_images writes a folder of images through write_imagefolder, a chunk at a time
    p = command("imagefolder", "your own images, a subfolder per class: PATH/CLASS/*.png", run=prepare_images)
    p.add_argument("path", metavar="PATH",
                   help="a folder of class subfolders of images (png, jpg, jpeg, bmp, webp)")
    p.add_argument("--data_dir", default="data/imagefolder",
                   help="where the arrays and meta.json go (default: %(default)s)")
    p.add_argument("--val", metavar="PATH",
                   help="a val folder laid out as PATH (default: --val_fraction)")
    p.add_argument("--val_fraction", type=float, default=0.1,
                   help="of each class held out for val, by path hash")
    p.add_argument("--image_size", type=int, default=32,
                   help="the shorter side resized to this, the centre cropped")
    p.add_argument("--flip_ok", action="store_true",
                   help="a mirror image is still of its class: the trainers may flip")
    p.add_argument("--workers", type=int, default=usable_cpus(),
                   help="processes that decode images (default: the CPUs this process may run on); 0 or 1: in this one")

    args, unknown = parser.parse_known_args(argv)
    if unknown:
        check_flags(unknown, args.command, commands.choices[args.command])
    # SIGTERM (a scheduler's stop, kill) is raised as Ctrl-C is, as KeyboardInterrupt: the staging folder and any new
    # folders are removed on the way out, and the command ends in one line instead of dying mid-write
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with leaving_nothing_new(args.data_dir or f"models/{args.model}"):  # gpt2's default folder
            args.run(args)
    except KeyboardInterrupt:
        fail("interrupted: nothing half-written is left; run the command again (a download resumes)")
    except (PermissionError, FileExistsError, NotADirectoryError) as e:  # a file where a folder goes
        fail(f"{e.filename}: {(e.strerror or type(e).__name__).lower()}; pass a --data_dir in a folder you can write")
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0

if __name__ == "__main__":
    sys.exit(main())
