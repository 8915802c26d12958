"""The course's data, made on this machine: nothing is downloaded, everything is deterministic.

    >>> from perflab.data import make_image_folder, decode_all, char_corpus, get_batch
    >>> data = make_image_folder()              # JPEG shapes in the ImageFolder layout, cached
    >>> corpus = char_corpus()                  # generated English-like text, tokenized by character

``images``: image classification files (generated shapes, or CIFAR-10 you already have).
``formats``: the same images as JPEG, PNG and a raw uint8 array, to compare storage formats.
``text``: a text corpus, a character tokenizer, and GPT batches.
"""

from perflab.data.formats import StoredImages, export_formats
from perflab.data.images import ImageFolderSplit, cifar10_image_folder, data_root, decode_all, make_image_folder
from perflab.data.text import CharCorpus, CharTokenizer, char_corpus, get_batch, make_text

__all__ = [
    "CharCorpus",
    "CharTokenizer",
    "ImageFolderSplit",
    "char_corpus",
    "cifar10_image_folder",
    "data_root",
    "StoredImages",
    "decode_all",
    "export_formats",
    "get_batch",
    "make_image_folder",
    "make_text",
]
