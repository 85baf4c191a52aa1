"""Fill-in-the-middle: the model's FIM tokens and the prompt they make.

The tokens are found in the vocabulary by the names model families give them
(<|fim_prefix|> in Qwen 2.5 Coder, <fim_prefix> in StarCoder, <PRE> in Code Llama...);
a model without prefix, suffix and middle tokens cannot infill (Unsupported, naming
what is missing). The prompt is prefix-suffix-middle, with the repository context first
so it stays warm while the code around the cursor changes on every keystroke:

    [<|repo_name|>name\\n] (<|file_sep|>path\\ntext)* <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>

User text is tokenized with special-token parsing off: code that spells a control
token stays text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..backends.base import Backend
from ..errors import InvalidInput, Unsupported

NAMES = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "▁<PRE>", "[PREFIX]"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<SUF>", "▁<SUF>", "[SUFFIX]"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<MID>", "▁<MID>", "[MIDDLE]"),
    "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<PAD>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}
MAX_EXTRA = 256


@dataclass(frozen=True)
class ExtraFile:
    """Repository context for an infill: a file's name and text."""

    filename: str
    text: str


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    def stops(self) -> tuple[int, ...]:
        """Tokens that end an infill: every FIM token the model may write after the middle."""
        return tuple(t for t in (self.pad, self.repo, self.file_sep, self.prefix, self.suffix) if t is not None)


def _lookup(backend: Backend, names: Sequence[str]) -> int | None:
    for name in names:
        ids = backend.tokenize(name, add_bos=False, parse_special=True)
        if len(ids) == 1 and backend.token_text(ids[0]) == name:
            return ids[0]
    return None


def find_fim_tokens(backend: Backend) -> FimTokens:
    found = {role: _lookup(backend, names) for role, names in NAMES.items()}
    missing = [role for role in ("prefix", "suffix", "middle") if found[role] is None]
    if missing:
        looked = "; ".join(f"{role}: {' '.join(NAMES[role][:3])}" for role in missing)
        raise Unsupported(
            "infill", f"the model's vocabulary has no fill-in-the-middle {', '.join(missing)} token ({looked})"
        )
    return FimTokens(**found)  # type: ignore[arg-type]


def check_extra(extra: Sequence[ExtraFile | dict[str, str]], param: str = "input_extra") -> tuple[ExtraFile, ...]:
    if len(extra) > MAX_EXTRA:
        raise InvalidInput(f"{param}: at most {MAX_EXTRA} files, got {len(extra)}", param=param)
    out = []
    for i, e in enumerate(extra):
        if isinstance(e, dict):
            e = ExtraFile(e.get("filename", ""), e.get("text", ""))  # type: ignore[arg-type]
        if not isinstance(e.filename, str) or not isinstance(e.text, str):
            raise InvalidInput(f"{param}[{i}]: filename and text must be strings", param=f"{param}[{i}]")
        out.append(e)
    return tuple(out)


def infill_tokens(
    backend: Backend,
    fim: FimTokens,
    prefix: str,
    suffix: str,
    extra: Sequence[ExtraFile] = (),
    *,
    add_bos: bool,
    repo: str | None = None,
) -> list[int]:
    """The prompt's tokens; repository context first, then the file being edited in PSM order."""

    def text(s: str) -> list[int]:
        return backend.tokenize(s, add_bos=False, parse_special=False) if s else []

    bos = backend.info.bos_token_id
    out: list[int] = [bos] if add_bos and bos is not None else []
    if repo is not None and fim.repo is not None:
        out += [fim.repo, *text(repo + "\n")]
    for f in extra:
        if fim.file_sep is not None:
            out += [fim.file_sep, *text(f"{f.filename}\n{f.text}")]
        else:
            out += text(f"--- {f.filename} ---\n{f.text}\n")
    return [*out, fim.prefix, *text(prefix), fim.suffix, *text(suffix), fim.middle]
