"""The course's data, made on this machine: nothing is downloaded, everything is deterministic.

    >>> from perflab.data import char_corpus, make_image_folder
    >>> make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    ImageFolderSplit(shapes3-32px-20train-4val-seed0: 3 classes, 60 train + 12 val JPEGs of 32x32 at ...)
    >>> char_corpus()                            # generated English-like text, tokenized by character
    CharCorpus(43 characters; 900131 train + 100015 val tokens)

``images``: image classification files (generated shapes, or CIFAR-10 you already have).
``formats``: the same images as JPEG, PNG and a raw uint8 array, to compare storage formats.
``text``: a text corpus, a character tokenizer, and GPT batches.

Used in: lectures 02, 03, 04, 07 and 08, labs 03 and 05.
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
