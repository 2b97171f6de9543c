"""Real token data (nvrx_lab.data): text to Megatron's indexed dataset and back, nanoGPT's flat files, samples by global
index (every sample once an epoch, the same batch at the same position), and the bad inputs named."""

from __future__ import annotations

import struct
import subprocess
import sys
from array import array

import pytest
import torch

from nvrx_lab.data.indexed import MAGIC, open_tokens, write_indexed
from nvrx_lab.data.prepare import prepare
from nvrx_lab.data.tokens import TokenDataset

TEXT = "The first paragraph.\nIts second line.\n\n\nA second paragraph: é, ü.\n\nThe third.\n"


def _megatron_index(path) -> tuple[int, list[int], list[int], list[int]]:
    """Megatron's ``_IndexReader`` written out: the dtype code, each sequence's length and byte offset, the document
    index."""
    raw = path.read_bytes()
    assert raw[:9] == MAGIC
    version, code, count, docs = struct.unpack_from("<QBQQ", raw, 9)
    assert version == 1
    at = len(MAGIC) + 25  # the magic, then <QBQQ
    sizes = list(struct.unpack_from(f"<{count}i", raw, at))
    pointers = list(struct.unpack_from(f"<{count}q", raw, at + 4 * count))
    doc_idx = list(struct.unpack_from(f"<{docs}q", raw, at + 12 * count))
    return code, sizes, pointers, doc_idx


def test_text_becomes_megatrons_indexed_dataset_a_paragraph_a_document(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    f = prepare([tmp_path / "a.txt"], tmp_path / "tok")
    paragraphs = ["The first paragraph.\nIts second line.\n", "A second paragraph: é, ü.\n", "The third.\n"]
    want = [b for p in paragraphs for b in [*p.encode("utf-8"), 0]]  # bytes, and 0 ending each document
    assert f.tokens.tolist() == want and f.documents == 3 and f.tokens.dtype == torch.uint16
    code, sizes, pointers, doc_idx = _megatron_index(tmp_path / "tok.idx")
    assert code == 8 and sizes == [len(p.encode()) + 1 for p in paragraphs]  # uint16
    assert pointers == [0, 2 * sizes[0], 2 * (sizes[0] + sizes[1])] and doc_idx == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "tok.bin", "tok.idx"]


def test_a_large_vocabulary_is_written_as_int32_and_an_id_outside_it_leaves_nothing(tmp_path):
    f = write_indexed(tmp_path / "big", [[1, 128000], [7]], vocab_size=128256)
    assert f.tokens.dtype == torch.int32 and f.tokens.tolist() == [1, 128000, 7]
    with pytest.raises(ValueError, match=r"document 1: a token id outside 0..255 \(300..300\)"):
        write_indexed(tmp_path / "bad", [[1, 2], [300]], vocab_size=256)
    assert not list(tmp_path.glob("bad*"))


def test_nanogpts_flat_file_reads_with_its_dtype_named(tmp_path):
    (tmp_path / "train.bin").write_bytes(array("H", [5, 6, 7, 65535]).tobytes())
    assert open_tokens(f"{tmp_path}/train.bin:uint16").tokens.tolist() == [5, 6, 7, 65535]
    with pytest.raises(ValueError, match=r"no index beside it .*train.bin:uint16 or .*train.bin:uint32"):
        open_tokens(tmp_path / "train.bin")


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"holds 10 bytes, its index says 14 \(a partial copy"),
    ("magic", r"is not a Megatron indexed dataset's index"),
    ("missing", r"no such file \(expected PREFIX"),
])
def test_a_damaged_or_missing_file_is_named(damage, message, tmp_path):
    write_indexed(tmp_path / "t", [[1, 2, 3], [4, 5, 6, 7]], vocab_size=256)
    if damage == "truncate":
        (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:10])
    elif damage == "magic":
        (tmp_path / "t.idx").write_bytes(b"NOTANIDX" + (tmp_path / "t.idx").read_bytes()[8:])
    with pytest.raises(ValueError, match=message):
        open_tokens(tmp_path / ("nothing" if damage == "missing" else "t"))


def test_samples_by_global_index_every_one_once_an_epoch_and_the_same_batch_at_the_same_position(tmp_path):
    f = write_indexed(tmp_path / "t", [list(range(i * 10, i * 10 + 10)) for i in range(10)], vocab_size=256)
    data = TokenDataset(f, seq_len=4, global_batch=3, seed=1)
    assert data.samples == (100 - 1) // 4 == 24
    epoch = [s for pos in range(8) for s in data.sample_ids(pos)]  # 8 batches of 3: one epoch
    assert sorted(epoch) == list(range(24))
    assert sorted(s - 24 for pos in range(8, 16) for s in data.sample_ids(pos)) == list(range(24))  # the next
    batch = data.global_batch_at(5)
    assert [row.tolist() for row in batch] == [list(range(4 * s, 4 * s + 5)) for s in data.sample_ids(5)]
    again = TokenDataset(tmp_path / "t", seq_len=4, global_batch=3, seed=1)
    assert torch.equal(again.global_batch_at(5), batch)  # a pure function of (seed, position)
    assert not torch.equal(TokenDataset(f, seq_len=4, global_batch=3, seed=2).global_batch_at(5), batch)


def test_a_resume_continues_the_stream_and_another_dataset_is_refused_by_name(tmp_path):
    f = write_indexed(tmp_path / "t", [list(range(100))], vocab_size=256)
    data = TokenDataset(f, seq_len=8, global_batch=4)
    data.next_batch(0, 2)
    data.next_batch(0, 2)
    resumed = TokenDataset(f, seq_len=8, global_batch=4)
    resumed.load_state_dict(data.state_dict())
    assert torch.equal(resumed.next_batch(1, 2)[0], data.next_batch(1, 2)[0])
    with pytest.raises(ValueError, match=r"trained on t.bin \(100 tokens, --seq-len 8\); this run reads t.bin \(100 "
                                         r"tokens, --seq-len 4\)"):
        TokenDataset(f, seq_len=4, global_batch=4).load_state_dict(data.state_dict())
    with pytest.raises(ValueError, match="trained on synthetic tokens"):
        resumed.load_state_dict({"seed": 0, "position": 3})
    with pytest.raises(ValueError, match=r"token id 96 at position 0 is outside the model's vocabulary of 64"):
        TokenDataset(f, seq_len=8, global_batch=40, vocab_size=64).global_batch_at(0)
    with pytest.raises(ValueError, match=r"100 tokens, fewer than one sample of --seq-len 128"):
        TokenDataset(f, seq_len=128, global_batch=4)


def test_the_command_line_prepares_text_says_what_it_wrote_and_names_a_bad_file(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    ok = subprocess.run([sys.executable, "-m", "nvrx_lab.data", "prepare", str(tmp_path / "a.txt"), "--out",
                         str(tmp_path / "tok")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "80 tokens (torch.uint16), 3 documents, megatron layout" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "nvrx_lab.data", "prepare", str(tmp_path / "latin1.txt"), "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith(f"error: {tmp_path / 'latin1.txt'}: not UTF-8 text")
    assert not list(tmp_path.glob("bad*"))
