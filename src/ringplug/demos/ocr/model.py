"""A small CRNN text recognizer (convolutions, then a bidirectional GRU) trained with CTC."""

from __future__ import annotations

import torch
from torch import nn

from .data import CHARSET


def _conv_block(inputs: int, outputs: int, stride: tuple[int, int]) -> nn.Sequential:
    """3x3 convolution that shrinks by ``stride`` (height, width), batch norm, ReLU."""
    # Strided convolutions rather than max-pooling: on one CPU thread, pooling and batch
    # norm over full-resolution activations cost more than all the convolutions.
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
    )


class CRNN(nn.Module):
    """Reads a line of text: per-column features from a CNN, context from a GRU, CTC output.

    The convolutions shrink the height to 1 and the width 4 times, so an image ``w`` pixels
    wide gives ``ceil(w / 4)`` frames, one score vector over the blank and `CHARSET` each.
    Padding on the right of an image does not leak into its frames' recurrent context: the
    GRU runs on packed sequences of each image's own length.

    Args:
        height: input image height in pixels; a multiple of 16. Defaults to 32.
        channels: output channels of the four convolution blocks; the last is the
            per-frame feature size. Defaults to ``(16, 32, 64, 96)``.
        hidden: GRU hidden size in each direction. Defaults to 64.
        classes: output classes, blank included. Defaults to ``len(CHARSET) + 1``.

    Example:
        >>> model = CRNN()
        >>> log_probs, lengths = model(torch.zeros(2, 1, 32, 100), torch.tensor([100, 60]))
        >>> log_probs.shape, lengths.tolist()
        (torch.Size([25, 2, 37]), [25, 15])
    """

    width_factor = 4
    """How many input columns make one output frame."""

    def __init__(
        self,
        height: int = 32,
        channels: tuple[int, int, int, int] = (16, 32, 64, 96),
        hidden: int = 64,
        classes: int = len(CHARSET) + 1,
    ) -> None:
        super().__init__()
        if height % 16 != 0:
            raise ValueError(f"CRNN needs an image height that is a multiple of 16, got {height}.")
        c1, c2, c3, c4 = channels
        self.features = nn.Sequential(
            _conv_block(1, c1, stride=(2, 2)),
            _conv_block(c1, c2, stride=(2, 2)),
            _conv_block(c2, c3, stride=(2, 1)),
            _conv_block(c3, c4, stride=(2, 1)),
        )
        # Whatever height is left (2 for 32-pixel lines) collapses into one frame.
        self.collapse = nn.Sequential(
            nn.Conv2d(c4, c4, kernel_size=(height // 16, 1), bias=False),
            nn.BatchNorm2d(c4),
            nn.ReLU(inplace=True),
        )
        self.rnn = nn.GRU(c4, hidden, bidirectional=True)
        self.classifier = nn.Linear(2 * hidden, classes)

    def output_lengths(self, widths: torch.Tensor) -> torch.Tensor:
        """Frames the model produces for images ``widths`` pixels wide."""
        # Each stride-2 convolution (kernel 3, padding 1) maps w columns to ceil(w / 2).
        return torch.div(widths + self.width_factor - 1, self.width_factor, rounding_mode="floor")

    def forward(
        self, images: torch.Tensor, widths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each frame of a padded batch.

        Args:
            images: ``[B, 1, height, W]`` float images, padded on the right to a common W.
            widths: ``[B]`` int64 width of each image before padding.

        Returns:
            ``(log_probs [T, B, classes], output_lengths [B])`` with ``T = ceil(W / 4)``, as
            `torch.nn.CTCLoss` takes them.
        """
        lengths = self.output_lengths(widths)
        frames = self.collapse(self.features(images))  # [B, C, 1, T]
        frames = frames.squeeze(2).permute(2, 0, 1)  # [T, B, C]
        packed = nn.utils.rnn.pack_padded_sequence(frames, lengths.cpu(), enforce_sorted=False)
        context, _ = self.rnn(packed)
        context, _ = nn.utils.rnn.pad_packed_sequence(context, total_length=frames.shape[0])
        return self.classifier(context).log_softmax(dim=-1), lengths
