"""Synthetic text lines for the OCR example: rendered on the fly, no downloads.

Every sample is a random string drawn in Pillow's built-in scalable font into a grayscale
image 32 pixels high whose width grows with the text, so both the inputs and the targets of
a batch vary in length. A sample depends only on ``(seed, index)``: any rank, process or
epoch that asks for sample ``i`` gets the same pixels.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

CHARSET = string.digits + string.ascii_lowercase
"""Characters the lines are made of; character ``c`` has label ``CHARSET.index(c) + 1``."""

BLANK = 0
"""Label of the CTC blank, which no character uses."""

BACKGROUND = 0.0
"""Pixel value of the background (and of `ringplug.data.pad_collate`'s default padding):
ink is bright."""

_FONT_SIZES = range(18, 25)
# Each character gets a cell at least this wide, so that a model that shrinks the width
# 4 times still sees 2 columns per character: CTC needs a blank between repeated labels,
# and "iiii" drawn tight would be 4 pixels a character.
_MIN_ADVANCE = 8
_SPACING = (1, 3)  # extra pixels between two characters, inclusive
_MARGIN = (2, 10)  # pixels left of the first and right of the last character, inclusive
_NOISE = 0.05  # standard deviation of the Gaussian pixel noise


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's default font at ``size`` pixels (scalable since Pillow 10.1)."""
    font = ImageFont.load_default(size=size)
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise RuntimeError(
            "ImageFont.load_default(size=...) returned a fixed bitmap font; "
            "the OCR example needs Pillow >= 10.1 built with FreeType."
        )
    return font


@functools.cache
def _advances(size: int) -> dict[str, int]:
    """Width in pixels of each character's cell at font ``size``."""
    font = _font(size)
    return {c: max(_MIN_ADVANCE, int(np.ceil(font.getlength(c)))) for c in CHARSET}


@functools.cache
def _ink_extent(size: int) -> tuple[int, int]:
    """Pixels the charset's ink reaches above and below the baseline at font ``size``."""
    _, top, _, bottom = _font(size).getbbox(CHARSET, anchor="ls")
    return -top, bottom


class _Layout(NamedTuple):
    """Where one sample's characters go; everything but the pixel noise."""

    text: str
    font_size: int
    xs: list[int]  # left edge of each character's cell
    baseline: int
    ink: float
    width: int


class TextLines(torch.utils.data.Dataset):
    """Random text lines rendered as grayscale images, for training a CTC text recognizer.

    Sample ``i`` is a string of ``min_chars`` to ``max_chars`` characters from `CHARSET`,
    drawn with a random font size, letter spacing, margins, baseline, ink brightness and
    pixel noise, all determined by ``(seed, i)``. The image is float32 in [0, 1] with
    shape ``(1, height, width)``; the background is `BACKGROUND`.

    Args:
        count: number of samples.
        seed: picks the set of samples; datasets with different seeds do not share them.
            Defaults to 0.
        min_chars: shortest line, in characters. Defaults to 2.
        max_chars: longest line, in characters. Defaults to 16.
        height: image height in pixels; at least 28, so the largest font fits.
            Defaults to 32.

    Attributes:
        lengths: each sample's image width in pixels, computed without drawing it (what a
            length-bucketing sampler sorts by).

    Example:
        >>> lines = TextLines(1000, seed=0)
        >>> image, target, index = lines[5]
        >>> image.shape[-1] == lines.lengths[5]
        True
    """

    def __init__(
        self,
        count: int,
        seed: int = 0,
        min_chars: int = 2,
        max_chars: int = 16,
        height: int = 32,
    ) -> None:
        if not 1 <= min_chars <= max_chars:
            raise ValueError(
                f"Need 1 <= min_chars <= max_chars, got min_chars={min_chars} "
                f"and max_chars={max_chars}."
            )
        tallest = max(sum(_ink_extent(size)) for size in _FONT_SIZES)
        if height < tallest + 2:
            raise ValueError(
                f"height={height} is too small for the largest font, whose ink "
                f"is {tallest} pixels tall; use height >= {tallest + 2}."
            )
        self.count = count
        self.seed = seed
        self.min_chars = min_chars
        self.max_chars = max_chars
        self.height = height
        self.lengths: list[int] = [self._layout(self._rng(i)).width for i in range(count)]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Return ``(image [1, height, width] float32, labels [chars] int64, index)``."""
        if not 0 <= index < self.count:
            raise IndexError(f"Sample {index} is out of range for {self.count} text lines.")
        rng = self._rng(index)
        layout = self._layout(rng)
        image = self._render(layout, rng)
        labels = torch.tensor([CHARSET.index(c) + 1 for c in layout.text], dtype=torch.int64)
        return torch.from_numpy(image).unsqueeze(0), labels, index

    def text(self, index: int) -> str:
        """The string sample ``index`` shows."""
        return self._layout(self._rng(index)).text

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, index))

    def _layout(self, rng: np.random.Generator) -> _Layout:
        """Draw everything about a sample but its noise, from the start of its ``rng``."""
        length = int(rng.integers(self.min_chars, self.max_chars + 1))
        text = "".join(CHARSET[k] for k in rng.integers(0, len(CHARSET), size=length))
        font_size = int(rng.integers(_FONT_SIZES.start, _FONT_SIZES.stop))
        advances = _advances(font_size)
        spacing = rng.integers(_SPACING[0], _SPACING[1] + 1, size=length - 1)
        left, right = (int(m) for m in rng.integers(_MARGIN[0], _MARGIN[1] + 1, size=2))
        xs = [left]
        for char, gap in zip(text[:-1], spacing, strict=True):
            xs.append(xs[-1] + advances[char] + int(gap))
        width = xs[-1] + advances[text[-1]] + right
        above, below = _ink_extent(font_size)
        baseline = int(rng.integers(above + 1, self.height - below))
        ink = float(rng.uniform(0.6, 1.0))
        return _Layout(text, font_size, xs, baseline, ink, width)

    def _render(self, layout: _Layout, rng: np.random.Generator) -> np.ndarray:
        """Draw ``layout`` into a float32 array of shape ``(height, width)``."""
        canvas = Image.new("L", (layout.width, self.height), 0)
        draw = ImageDraw.Draw(canvas)
        font = _font(layout.font_size)
        advances = _advances(layout.font_size)
        for char, x in zip(layout.text, layout.xs, strict=True):
            # Centre narrow glyphs in their widened cell.
            offset = (advances[char] - font.getlength(char)) / 2
            draw.text((x + offset, layout.baseline), char, fill=255, font=font, anchor="ls")
        image = np.asarray(canvas, dtype=np.float32) * (layout.ink / 255.0)
        image += rng.normal(0.0, _NOISE, size=image.shape).astype(np.float32)
        return np.clip(image, 0.0, 1.0, out=image)


def decode_greedy(log_probs: torch.Tensor, input_lengths: torch.Tensor) -> list[list[int]]:
    """Best-path CTC decoding: argmax per frame, merge repeats, drop blanks.

    Args:
        log_probs: ``[T, B, C]`` scores per frame (log-probabilities or logits).
        input_lengths: ``[B]`` number of valid frames of each sequence.

    Returns:
        One list of labels (1..len(CHARSET)) per sequence.
    """
    best = log_probs.argmax(dim=-1).T.tolist()  # [B, T]
    decoded = []
    for frames, length in zip(best, input_lengths.tolist(), strict=True):
        labels = []
        previous = BLANK
        for label in frames[:length]:
            if label != previous and label != BLANK:
                labels.append(label)
            previous = label
        decoded.append(labels)
    return decoded


def labels_to_text(labels: Sequence[int]) -> str:
    """The string that a sequence of labels (blank excluded) spells."""
    return "".join(CHARSET[label - 1] for label in labels)


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance: fewest insertions, deletions and substitutions from a to b."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def cer(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> float:
    """Character error rate: total edit distance over total target characters."""
    if len(predictions) != len(targets):
        raise ValueError(
            f"Got {len(predictions)} predictions for {len(targets)} targets; "
            "pass one prediction per target."
        )
    total = sum(len(target) for target in targets)
    if total == 0:
        raise ValueError("The targets hold no characters, so the error rate is undefined.")
    errors = sum(edit_distance(p, t) for p, t in zip(predictions, targets, strict=True))
    return errors / total
