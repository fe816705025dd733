"""Tokenizers for GLM-5 training: one small wrapper over a Hugging Face fast tokenizer or a sentencepiece model.

GLM-5's chat format (rendered by the checkpoint's ``chat_template.jinja``)::

    [gMASK]<sop><|system|>You are ...<|user|>What is 3 plus 4?<|assistant|><think>3 + 4 = 7</think>3 plus 4 is 7.

No newline follows a role token; every assistant turn opens a ``<think>…</think>`` block (empty without
reasoning); tool calls are ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`` and tool
results come back as ``<|observation|><tool_response>…</tool_response>`` turns.  GLM-5 stops generating at
``<|endoftext|>``, ``<|user|>`` or ``<|observation|>`` (``stop_ids``).

``load_tokenizer("tiny")`` (or ``None``) gives the shipped tiny byte-level BPE (``megatron_glm5/assets/tokenizer``,
vocabulary 512 with the same special tokens in GLM-5's order) for tests and the tiny model presets.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from megatron_glm5.errors import UserError

__all__ = [
    "GLM5Tokenizer",
    "load_tokenizer",
    "TokenizerLike",
    "TokenizerNotFoundError",
    "ChatTemplateError",
    "GLM_SPECIAL_TOKENS",
    "TINY_TOKENIZER_DIR",
    "DEFAULT_CHAT_TEMPLATE_PATH",
]

logger = logging.getLogger(__name__)

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
TINY_TOKENIZER_DIR = os.path.join(ASSETS_DIR, "tokenizer")
DEFAULT_CHAT_TEMPLATE_PATH = os.path.join(TINY_TOKENIZER_DIR, "chat_template.jinja")

# GLM-5's control tokens in the order of their ids in the real vocabulary (<|endoftext|> = 154820 ...).
GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
EOD_TOKEN = "<|endoftext|>"
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


class TokenizerNotFoundError(UserError, FileNotFoundError):
    """The tokenizer path does not exist or lacks the files a tokenizer needs."""


class ChatTemplateError(UserError, ValueError):
    """A chat template is missing, fails to render, or renders conversations in a way we cannot train on."""


class GLM5Tokenizer:
    """Uniform tokenizer API over a HF fast tokenizer (``backend="hf"``) or sentencepiece (``backend="sentencepiece"``).

    Attributes: ``vocab_size`` (all ids incl. added tokens), ``eod_id``, ``pad_id``, ``special_ids`` (token ->
    id, for the GLM control tokens this vocabulary has plus the tokenizer's own special tokens), ``stop_ids``
    (ids that end an assistant turn), ``name_or_path`` (what :func:`load_tokenizer` was given; the object pickles
    by reloading from it), ``source`` (the directory or ``.model`` file it was read from), ``chat_template`` (jinja
    source).

    Use :func:`load_tokenizer` to make one.
    """

    def __init__(self, backend: str, impl: Any, name_or_path: str, chat_template: Optional[str],
                 eod_id: int, pad_id: int, special_ids: Dict[str, int]):
        self.backend = backend
        self._impl = impl
        self.name_or_path = name_or_path
        self.source: Optional[str] = None  # the directory or .model file it was read from (set by the loaders)
        self.chat_template = chat_template
        self.eod_id = int(eod_id)
        self.pad_id = int(pad_id)
        self.special_ids = dict(special_ids)
        self.stop_ids = [self.special_ids[t] for t in STOP_TOKENS if t in self.special_ids]
        if self.eod_id not in self.stop_ids:
            self.stop_ids.insert(0, self.eod_id)
        self._id_to_special = {v: k for k, v in self.special_ids.items()}
        # longest first, so that a token is matched before the tokens it contains
        self._special_re = re.compile("|".join(map(re.escape, sorted(self.special_ids, key=len, reverse=True))))

    # -------------------------------------------------------------------------------------------- basics
    @property
    def vocab_size(self) -> int:
        if self.backend == "hf":
            return len(self._impl)
        return int(self._impl.get_piece_size())

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"GLM5Tokenizer({self.name_or_path!r}, backend={self.backend}, vocab_size={self.vocab_size}, "
                f"eod_id={self.eod_id}, pad_id={self.pad_id})")

    def __reduce__(self):
        # Reload in the receiving process (multiprocessing workers) instead of pickling the Rust/C++ object.
        return (load_tokenizer, (self.name_or_path,))

    def token_to_id(self, token: str) -> Optional[int]:
        if self.backend == "hf":
            i = self._impl.convert_tokens_to_ids(token)
            return None if i is None or (i == self._impl.unk_token_id and token != self._impl.unk_token) else int(i)
        i = self._impl.piece_to_id(token)
        return None if i == self._impl.unk_id() and token != self._impl.id_to_piece(i) else int(i)

    def id_to_token(self, token_id: int) -> str:
        if self.backend == "hf":
            return self._impl.convert_ids_to_tokens(int(token_id))
        return self._impl.id_to_piece(int(token_id))

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``; special-token strings in it become their ids; nothing is prepended/appended."""
        if self.backend == "hf":
            return list(self._impl.encode(text, add_special_tokens=False))
        ids: List[int] = []
        pos = 0
        for m in self._special_re.finditer(text) if self.special_ids else ():
            if m.start() > pos:
                ids.extend(self._impl.encode(text[pos:m.start()]))
            ids.append(self.special_ids[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(self._impl.encode(text[pos:]))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self.backend == "hf":
            return self._impl.decode(ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
        out: List[str] = []
        run: List[int] = []
        for i in ids:
            if i in self._id_to_special:
                if run:
                    out.append(self._impl.decode(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self._id_to_special[i])
            else:
                run.append(i)
        if run:
            out.append(self._impl.decode(run))
        return "".join(out)

    # -------------------------------------------------------------------------------------------- chat
    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]] = None,
                    add_generation_prompt: bool = False, **template_kwargs) -> str:
        """The chat as text, rendered by this tokenizer's jinja chat template."""
        if not self.chat_template:
            raise ChatTemplateError(f"tokenizer {self.name_or_path!r} has no chat template: put a chat_template.jinja "
                                    f"next to it (see {DEFAULT_CHAT_TEMPLATE_PATH})")
        from jinja2.exceptions import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        messages = [normalize_message(m) for m in messages]
        if self.backend == "hf":  # what transformers' apply_chat_template passes too (bos_token, eos_token, ...)
            template_kwargs = {**self._impl.special_tokens_map, **template_kwargs}
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=list(tools) if tools else None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, **template_kwargs)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.name_or_path!r} failed to render: {e}") from e
        return rendered[0]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]] = None,
                            add_generation_prompt: bool = False, **template_kwargs) -> List[int]:
        """Token ids of the rendered chat (GLM-5 shape: ``[gMASK]<sop><|user|>…<|assistant|><think>…</think>…``)."""
        return self.encode(self.render_chat(messages, tools, add_generation_prompt, **template_kwargs))

    # -------------------------------------------------------------------------------------------- megatron
    def megatron_tokenizer(self) -> "MegatronTokenizerAdapter":
        """The object megatron-core's datasets expect as ``config.tokenizer`` (eod, pad, vocab_size, identity)."""
        return MegatronTokenizerAdapter(self)


class MegatronTokenizerAdapter:
    """What ``megatron.core.datasets`` reads from ``GPTDatasetConfig.tokenizer``.

    ``pad`` is -1 (no pad id), as for megatron's NullTokenizer: GLM's pad token is ``<|endoftext|>``, the document
    separator inside pretraining data, and GPTDataset would otherwise mask it out of the loss (it warns and does
    this same substitution itself when pad and eod collide).
    """

    def __init__(self, tokenizer: GLM5Tokenizer):
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    @property
    def eod(self) -> int:
        return self._tok.eod_id

    @property
    def pad(self) -> int:
        return -1

    @property
    def unique_identifiers(self) -> "OrderedDict[str, Any]":
        return OrderedDict(
            [("class", "megatron_glm5.GLM5Tokenizer"), ("name_or_path", os.path.abspath(self._tok.name_or_path)
                                                          if os.path.exists(self._tok.name_or_path)
                                                          else self._tok.name_or_path),
             ("vocab_size", self.vocab_size), ("eod", self.eod)])


def normalize_message(message: Mapping[str, Any]) -> Dict[str, Any]:
    """A plain dict copy of a chat message whose tool-call ``arguments`` are dicts (OpenAI sends JSON strings)."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be a dict, got {type(message).__name__}")
    out = {k: v for k, v in message.items() if v is not None}
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = call.get("function", call)
            args = fn.get("arguments") if isinstance(fn, Mapping) else None
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise ChatTemplateError(f"tool call arguments are not valid JSON: {args[:80]!r} ({e})") from e
                if "function" in call:
                    call["function"] = {**call["function"], "arguments": parsed}
                else:
                    call["arguments"] = parsed
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


# ------------------------------------------------------------------------------------------------ loading

def _read_default_template() -> Optional[str]:
    try:
        with open(DEFAULT_CHAT_TEMPLATE_PATH, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _load_hf(directory: str, name_or_path: str) -> GLM5Tokenizer:
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        present = sorted(os.listdir(directory))
        raise TokenizerNotFoundError(
            f"tokenizer directory {directory!r} lacks {', '.join(missing)} (it has: {', '.join(present) or 'nothing'});"
            f" give a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json [+ chat_template.jinja])"
            f", a sentencepiece .model file, or 'tiny'")
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise TokenizerNotFoundError(f"could not load the tokenizer in {directory!r}: {e}") from e
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    if isinstance(hf.chat_template, dict):  # several named templates: take the default
        template = hf.chat_template.get("default")
    if template is None:
        logger.warning("tokenizer %s has no chat template; using the GLM-5-shaped default %s", directory,
                       DEFAULT_CHAT_TEMPLATE_PATH)
        template = _read_default_template()

    vocab = hf.get_vocab()
    special_ids = {t: int(vocab[t]) for t in GLM_SPECIAL_TOKENS if t in vocab}
    for t in hf.all_special_tokens:
        if t in vocab:
            special_ids.setdefault(t, int(vocab[t]))
    if EOD_TOKEN in vocab:
        eod = vocab[EOD_TOKEN]
    elif hf.eos_token_id is not None:
        eod = hf.eos_token_id
    else:
        raise TokenizerNotFoundError(f"tokenizer in {directory!r} has neither {EOD_TOKEN} nor an eos_token; set "
                                     f"eos_token in its tokenizer_config.json")
    pad = hf.pad_token_id if hf.pad_token_id is not None else eod
    tok = GLM5Tokenizer("hf", hf, name_or_path, template, eod, pad, special_ids)
    tok.source = directory
    return tok


def _sentencepiece_user_defined(model_file: str) -> Dict[str, int]:
    """USER_DEFINED pieces (always matched whole, like added tokens), read from the model proto when possible."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf
        proto = pb.ModelProto()
        with open(model_file, "rb") as f:
            proto.ParseFromString(f.read())
    except Exception:  # noqa: BLE001 - optional: GLM control tokens are found by name anyway
        return {}
    user_defined = pb.ModelProto.SentencePiece.USER_DEFINED
    return {p.piece: i for i, p in enumerate(proto.pieces) if p.type == user_defined}


def _load_sentencepiece(model_file: str, name_or_path: str) -> GLM5Tokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(model_file)
    except Exception as e:  # noqa: BLE001
        raise TokenizerNotFoundError(f"could not load sentencepiece model {model_file!r}: {e}") from e
    special_ids: Dict[str, int] = {}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i):
            special_ids[sp.id_to_piece(i)] = i
    for piece in GLM_SPECIAL_TOKENS:
        i = sp.piece_to_id(piece)
        if i != sp.unk_id() and sp.id_to_piece(i) == piece:
            special_ids[piece] = i
    special_ids.update(_sentencepiece_user_defined(model_file))
    if EOD_TOKEN in special_ids:
        eod = special_ids[EOD_TOKEN]
    elif sp.eos_id() >= 0:
        eod = sp.eos_id()
    else:
        raise TokenizerNotFoundError(f"sentencepiece model {model_file!r} has neither {EOD_TOKEN} nor an eos piece")
    pad = sp.pad_id() if sp.pad_id() >= 0 else eod
    template_file = os.path.join(os.path.dirname(os.path.abspath(model_file)), "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            template = f.read()
    else:
        template = _read_default_template()
    tok = GLM5Tokenizer("sentencepiece", sp, name_or_path, template, eod, pad, special_ids)
    tok.source = model_file
    return tok


#: what load_tokenizer takes: a tokenizer, a path or name, or None (the tiny tokenizer)
TokenizerLike = Union[GLM5Tokenizer, str, os.PathLike, None]


def load_tokenizer(path_or_name: TokenizerLike = None) -> GLM5Tokenizer:
    """Load a tokenizer, offline.

    ``path_or_name``: ``None`` or ``"tiny"`` (the shipped tiny tokenizer); a Hugging Face tokenizer directory
    (``tokenizer.json`` + ``tokenizer_config.json``, optional ``chat_template.jinja`` — e.g. a GLM-5 checkpoint
    directory); a sentencepiece ``.model`` file (or a directory holding ``tokenizer.model``), whose chat template
    is ``chat_template.jinja`` beside it or else the default GLM-5-shaped template; a Hub repo id already in the
    local Hugging Face cache; or a :class:`GLM5Tokenizer` (returned as is).
    """
    if isinstance(path_or_name, GLM5Tokenizer):
        return path_or_name
    if path_or_name is None or str(path_or_name) == "tiny":
        return _load_hf(TINY_TOKENIZER_DIR, "tiny")
    name = os.fspath(path_or_name)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(
                os.path.join(path, "tokenizer.model")):
            return _load_sentencepiece(os.path.join(path, "tokenizer.model"), name)
        return _load_hf(path, name)
    if os.path.isfile(path):
        if path.endswith(".model"):
            return _load_sentencepiece(path, name)
        if os.path.basename(path) == "tokenizer.json":
            return _load_hf(os.path.dirname(path) or ".", name)
        raise TokenizerNotFoundError(f"{path!r} is a file but not a sentencepiece .model file; give a tokenizer "
                                     f"directory (tokenizer.json + tokenizer_config.json) or a .model file")
    # maybe a Hub repo id in the local cache (never downloads)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(name, local_files_only=True,
                                      allow_patterns=["tokenizer*", "chat_template*", "*.model"])
            return _load_hf(local, name)
        except TokenizerNotFoundError:
            raise
        except Exception:  # noqa: BLE001 - fall through to the not-found error
            pass
    raise TokenizerNotFoundError(
        f"tokenizer {name!r} not found: no such file or directory (and not in the local Hugging Face cache). "
        f"Give a tokenizer directory, a sentencepiece .model file, or 'tiny'")
