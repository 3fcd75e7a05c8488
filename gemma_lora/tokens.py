"""The tokenizer without TensorFlow: text to ids and back through SentencePiece itself, the vocabulary read
from its processor as asked (not held twice more), and llguidance's view of it for structured output."""
import collections.abc
import os
import re
from pathlib import Path

import numpy as np


def make_text_codec(tokenizer):
    """(encode, decode) without TensorFlow: SentencePiece directly for Gemma-family tokenizers."""
    sp = sentence_piece(tokenizer)
    if sp is not None:
        return sp.encode, sp.decode
    return (lambda text: np.asarray(tokenizer(text)).tolist()), (lambda ids: str(tokenizer.detokenize(ids)))


def sentence_piece(tokenizer):
    """The SentencePieceProcessor of a keras-hub SentencePiece tokenizer (None for any other): keras-hub's
    own when it has one. Each costs its vocabulary's size in RSS (Gemma 3's 262,144 pieces: 44 MiB), and the
    text codec and the grammar's token table both use it."""
    proto = getattr(tokenizer, "proto", None)
    if proto is None:
        return None
    import sentencepiece
    own = getattr(tokenizer, "_sentence_piece_spm", None)
    if isinstance(own, sentencepiece.SentencePieceProcessor):
        return own
    if isinstance(proto, (str, os.PathLike)):
        proto = Path(proto).read_bytes()
    return sentencepiece.SentencePieceProcessor(model_proto=proto)


class SentencePieces(collections.abc.Sequence):
    """A SentencePiece vocabulary read from its processor as asked: piece by id, `in`, len. keras-hub's
    tokenizer keeps the whole vocabulary twice more, as a list of strings and a dict back to ids (Gemma 3's
    262,144 pieces: 37 MiB of RSS), for what the processor answers itself."""

    def __init__(self, processor):
        self.processor, self.size = processor, processor.get_piece_size()  # a loaded vocabulary never changes

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        return self.processor.id_to_piece(i % self.size)

    def __contains__(self, piece):
        return self.id(piece) is not None

    def id(self, piece):
        """The piece's id, or None: SentencePiece answers an unknown piece with the unknown token's id."""
        if not isinstance(piece, str):
            return None
        i = self.processor.piece_to_id(piece)
        return i if self.processor.id_to_piece(i) == piece else None


class SentencePieceIds(collections.abc.Mapping):
    """The piece -> id dict keras-hub's tokenizer keeps, answered by the processor (see SentencePieces)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def __getitem__(self, piece):
        i = self.pieces.id(piece)
        if i is None:
            raise KeyError(piece)
        return i

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self):
        return len(self.pieces)


def pieces_of(tokenizer):
    """A tokenizer's pieces by id, with `in`: a SentencePieces view of keras-hub's SentencePiece tokenizers,
    whose own list and dict it then replaces (keras-hub reads them through the same operations), so the
    vocabulary is held once, in the processor; any other tokenizer's get_vocabulary()."""
    processor = sentence_piece(tokenizer)
    if processor is None or not hasattr(tokenizer, "_token_to_id_map"):
        return tokenizer.get_vocabulary()
    pieces = getattr(tokenizer, "_vocabulary", None)
    if not isinstance(pieces, SentencePieces):
        pieces = SentencePieces(processor)
        tokenizer._vocabulary, tokenizer._token_to_id_map = pieces, SentencePieceIds(pieces)
    return pieces


# Pieces that mark structure (chat turns, images, placeholders), never text a grammar may spell out.
MARKER_PIECES = re.compile(r"<(start|end)_of_(turn|image)>|<mask>|\[multimodal\]|<image_soft_token>|<unused\d+>")


def grammar_tokenizer(tokenizer, vocabulary_size, stop_ids):
    """llguidance's view of a SentencePiece vocabulary, for structured output: '▁' is a space, '<0xNN>' one
    raw byte, control pieces, chat/image markers and the stop tokens are special (never text), and the
    stop tokens end a finished grammar. None for a tokenizer that is not SentencePiece."""
    proto = getattr(tokenizer, "proto", None)
    if proto is None:
        return None
    import llguidance
    from sentencepiece import sentencepiece_model_pb2
    if isinstance(proto, (str, os.PathLike)):
        proto = Path(proto).read_bytes()
    pieces = sentencepiece_model_pb2.ModelProto.FromString(proto).pieces
    sp = sentence_piece(tokenizer)

    class Vocabulary:  # the attributes and call llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id = min(stop_ids), tokenizer.start_token_id

        def __init__(self):
            self.tokens, self.special_token_ids = [], []

        def __call__(self, text):
            return sp.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
    vocabulary = Vocabulary()
    for i, piece in enumerate(pieces):
        # SentencePiece piece types: 2 unknown, 3 control, 5 unused, 6 byte; 4 (user-defined) is text too,
        # as Gemma's newline and space runs and HTML tags are.
        if piece.type in (2, 3, 5) or i in stop_ids or MARKER_PIECES.fullmatch(piece.piece):
            vocabulary.tokens.append(b"\xff" + piece.piece.encode())
            vocabulary.special_token_ids.append(i)
        elif piece.type == 6:
            vocabulary.tokens.append(bytes([int(piece.piece[3:5], 16)]))
        else:
            vocabulary.tokens.append(piece.piece.replace("\u2581", " ").encode())
    vocabulary.tokens += [b""] * (vocabulary_size - len(vocabulary.tokens))
    wrapper = llguidance.TokenizerWrapper(vocabulary)
    table = llguidance.LLTokenizer(wrapper, n_vocab=vocabulary_size, eos_token=sorted(stop_ids))
    wrapper.tokens = vocabulary.tokens = None  # copied into llguidance's table; Gemma's are 13 MiB of bytes objects
    return table
