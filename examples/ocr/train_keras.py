"""Train a CRNN to read synthetic text lines with Keras 3 (TensorFlow) and ringplug.keras.

    ringrun -np 2 python examples/ocr/train_keras.py

The Keras twin of train_lightning.py. Every rank renders its own text lines on the fly (no
download); `bucketed_dataset` gives each rank whole batches of lines of similar widths, the
same number on every rank, padded by `ringplug.data.pad_numpy`. The model is trained with
CTC over each line's own frames, `DistributedOptimizer` averages the gradients, and after
every epoch each rank decodes its share of the validation lines and the ranks add up their
errors, so that rank 0 prints the character error rate (CER) of the whole validation set.
"""

from __future__ import annotations

import os

# Keras reads its backend once, at import; TensorFlow reads its log level when it loads.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import ringplug  # noqa: E402
import ringplug.keras as rk  # noqa: E402
from ringplug.demos.ocr import BLANK, CHARSET, TextLines, decode_greedy, edit_distance  # noqa: E402

WIDTH_FACTOR = 4
"""How many input columns make one output frame: two stride-2 convolutions."""

HEIGHT = 32
"""Height of the text lines in pixels."""


def output_lengths(widths):
    """Frames the model produces for images ``widths`` pixels wide: ceil(width / 4)."""
    # A stride-2 convolution with "same" padding maps w columns to ceil(w / 2).
    return (widths + WIDTH_FACTOR - 1) // WIDTH_FACTOR


def conv_block(filters: int, strides: tuple[int, int]) -> list[keras.layers.Layer]:
    """3x3 convolution that shrinks by ``strides`` (height, width), batch norm, ReLU."""
    return [
        keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
    ]


class CRNN(keras.Model):
    """Reads a line of text: per-column features from a CNN, context from a GRU, CTC output.

    The Keras counterpart of `ringplug.demos.ocr.CRNN`. The convolutions shrink the height
    to 1 and the width 4 times, so an image ``w`` pixels wide gives ``ceil(w / 4)`` frames,
    each a vector of logits over the blank (class 0) and `CHARSET`. The GRU masks the frames
    past each line's own length, so padding on the right does not leak into its context.
    The loss is CTC over those frames, averaged over the batch's lines.

    Args:
        channels: output channels of the four convolution blocks; the last is the per-frame
            feature size. Defaults to ``(16, 32, 64, 96)``.
        hidden: GRU units in each direction. Defaults to 64.
        classes: output classes, blank included. Defaults to ``len(CHARSET) + 1``.

    Call it on ``(images [B, 32, W, 1] float32, widths [B] int64)``; it returns logits
    ``[B, ceil(W / 4), classes]``. Fit it on ``((images, widths), (targets, target_lengths))``.
    """

    def __init__(self, channels: tuple[int, int, int, int] = (16, 32, 64, 96),
                 hidden: int = 64, classes: int = len(CHARSET) + 1) -> None:  # fmt: skip
        super().__init__()
        c1, c2, c3, c4 = channels
        self.features = keras.Sequential([
            *conv_block(c1, strides=(2, 2)),
            *conv_block(c2, strides=(2, 2)),
            *conv_block(c3, strides=(2, 1)),
            *conv_block(c4, strides=(2, 1)),
            # Whatever height is left (2 for 32-pixel lines) collapses into one frame.
            keras.layers.Conv2D(c4, (HEIGHT // 16, 1), use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
        ])  # fmt: skip
        self.rnn = keras.layers.Bidirectional(keras.layers.GRU(hidden, return_sequences=True))
        self.classifier = keras.layers.Dense(classes)

    def call(self, inputs, training=False):
        images, widths = inputs
        frames = keras.ops.squeeze(self.features(images, training=training), axis=1)  # [B, T, C]
        steps = keras.ops.arange(keras.ops.shape(frames)[1])
        mask = steps[None, :] < output_lengths(keras.ops.cast(widths, "int32"))[:, None]
        context = self.rnn(frames, mask=mask, training=training)
        return self.classifier(context)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        _, widths = x
        targets, target_lengths = y
        # keras.ops.ctc_loss takes logits, and mask_index is the blank's class.
        per_line = keras.ops.ctc_loss(targets, y_pred, target_lengths, output_lengths(widths),
                                      mask_index=BLANK)  # fmt: skip
        return keras.ops.mean(per_line)


class CharacterErrorRate(keras.callbacks.Callback):
    """After every epoch, the CER of the validation lines, computed together by all ranks.

    RingBroadcast, earlier in the callbacks, has just given every rank rank 0's non-trainable
    weights (batch norm's moving statistics, which each rank updates from its own batches),
    so all ranks evaluate one model.
    Each rank decodes its own batches of `dataset` (greedy CTC decoding), the ranks add up
    their edit errors and characters, and rank 0 prints the rate. Every rank puts it in
    ``logs["val_cer"]``. As in the Lightning example, a few lines may count twice: when the
    batches do not divide by the ranks, `bucketed_dataset` repeats some to even them out.

    Args:
        dataset: this rank's validation batches, as `fit` takes them.
    """

    def __init__(self, dataset: tf.data.Dataset) -> None:
        super().__init__()
        self.dataset = dataset
        self.rate = float("nan")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        errors = chars = 0
        for (images, widths), (targets, target_lengths) in self.dataset.as_numpy_iterator():
            logits = self.model.predict_on_batch((images, widths))  # [B, T, classes]
            lengths = output_lengths(widths)
            predicted = decode_greedy(torch.from_numpy(logits).transpose(0, 1),
                                      torch.from_numpy(lengths))  # fmt: skip
            truth = [t[:n].tolist() for t, n in zip(targets, target_lengths, strict=True)]
            errors += sum(map(edit_distance, predicted, truth))
            chars += int(target_lengths.sum())
        totals = ringplug.allreduce(np.array([errors, chars], dtype=np.int64), op="sum")
        self.rate = float(totals[0] / totals[1])
        if logs is not None:
            logs["val_cer"] = self.rate
        if ringplug.rank() == 0:
            print(f"\nepoch {epoch + 1}: character error rate {self.rate:.4f}", flush=True)


def text_line_batches(lines: TextLines, batch_size: int, shuffle: bool) -> tf.data.Dataset:
    """This rank's padded batches of `lines`, channels last, as `fit` takes them:
    ``((images [B, 32, W, 1], widths [B]), (targets [B, L], target_lengths [B]))``."""

    def load(index: int) -> tuple[np.ndarray, np.ndarray, int]:
        image, labels, index = lines[index]
        return image.numpy(), labels.numpy(), index

    signature = (
        tf.TensorSpec([None, 1, HEIGHT, None], tf.float32),  # images, padded on the right
        tf.TensorSpec([None], tf.int64),  # widths
        tf.TensorSpec([None, None], tf.int64),  # targets, padded with the blank
        tf.TensorSpec([None], tf.int64),  # target lengths
        tf.TensorSpec([None], tf.int64),  # sample indices
    )
    batches = rk.bucketed_dataset(load, lines.lengths, signature, batch_size=batch_size,
                                  shuffle=shuffle)  # fmt: skip

    def for_fit(images, widths, targets, target_lengths, _):
        return (tf.transpose(images, [0, 2, 3, 1]), widths), (targets, target_lengths)

    return batches.map(for_fit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=8000, help="training lines (all ranks)")
    parser.add_argument("--val-lines", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="lines per batch and rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    rk.init()  # before TensorFlow's first op, which fixes its thread pools
    train = text_line_batches(TextLines(args.lines, seed=0), args.batch_size, shuffle=True)
    val = text_line_batches(TextLines(args.val_lines, seed=1), args.batch_size, shuffle=False)

    keras.utils.set_random_seed(0)
    model = CRNN()
    model((np.zeros((1, HEIGHT, 8, 1), np.float32), np.array([8])))  # build the weights
    steps = args.epochs * int(train.cardinality())
    schedule = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=steps)
    optimizer = keras.optimizers.Adam(schedule, global_clipnorm=5.0)
    model.compile(optimizer=rk.DistributedOptimizer(optimizer), jit_compile=False)
    error_rate = CharacterErrorRate(val)

    start = time.perf_counter()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=rk.verbose(),
              callbacks=[rk.RingMetricAverage(), rk.RingBroadcast(0), error_rate])  # fmt: skip
    if ringplug.rank() == 0:
        seconds = time.perf_counter() - start
        print(f"final character error rate {error_rate.rate:.4f} after {args.epochs} epochs "
              f"on {ringplug.size()} ranks in {seconds:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
