"""Synthetic text-line OCR: rendered lines whose width grows with the text (`TextLines`),
a small CRNN for CTC (`CRNN`), greedy decoding and the character error rate.

Needs torch and Pillow (``pip install 'ringplug[demo]'``).
"""

from .data import BLANK, CHARSET, TextLines, cer, decode_greedy, edit_distance, labels_to_text
from .model import CRNN

__all__ = [
    "BLANK",
    "CHARSET",
    "CRNN",
    "TextLines",
    "cer",
    "decode_greedy",
    "edit_distance",
    "labels_to_text",
]
