"""Media inputs of the native ``/generate`` API: decoding, placeholder token counts, prompt
expansion.

``image_data``, ``audio_data`` and ``video_data`` each take one string or a list of strings,
each the bytes of one item (``_decode_string`` says the encodings). The tokenizer manager
decodes each item here, counts its placeholder tokens (``image_tokens``, ``audio_tokens``,
``video_tokens``), and puts that many copies of the kind's placeholder token (``<|image|>``,
``<|audio|>``, ``<|video|>``) in front of the prompt (``expand_prompt``). The model never sees
the pixels or samples: the count is what the scheduler's stats report as ``image_tokens``,
``audio_tokens`` and ``video_tokens``. Every refusal is a ``MediaError``.
"""

from __future__ import annotations

import base64
import binascii
import re
import wave
from collections.abc import Mapping, Sequence
from io import BytesIO

from PIL import Image

from pipeline.io_struct import MediaItem, MediaKind
from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = [
    "AUDIO_MAX_TOKENS",
    "AUDIO_TOKENS_PER_SECOND",
    "IMAGE_FORMATS",
    "IMAGE_MAX_TOKENS",
    "IMAGE_PATCH_SIZE",
    "MAX_ITEM_BYTES",
    "MAX_ITEMS_PER_KIND",
    "MEDIA_KINDS",
    "MediaError",
    "VIDEO_MAX_FRAMES",
    "VIDEO_MAX_TOKENS",
    "VIDEO_PATCH_SIZE",
    "audio_tokens",
    "expand_prompt",
    "image_tokens",
    "parse_media",
    "video_tokens",
]

MEDIA_KINDS: tuple[MediaKind, ...] = ("image", "audio", "video")
"""The kinds in prompt order."""

# At most 16 items per kind per request, and at most 20 MiB per decoded item. For too many
# items the error names the first item over the limit (``image_data[16]``). An item whose
# base64 text is already too long is refused before it is decoded. The whole request body is
# bounded first, while it is read, by ``--max-request-bytes`` (64 MiB by default, 413 beyond
# it): so the total of all items is at most that, and one item's base64 text (~26.7 MiB at the
# 20 MiB limit) fits in the default; a smaller body limit refuses a large item before this
# module sees it.
MAX_ITEMS_PER_KIND = 16
MAX_ITEM_BYTES = 20 * 1024 * 1024

IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""Pillow format names accepted for images and videos. A short list: every other Pillow
plugin is a parser of untrusted bytes that no client of this API needs."""

IMAGE_PATCH_SIZE = 28
IMAGE_MAX_TOKENS = 1024

AUDIO_TOKENS_PER_SECOND = 25
AUDIO_MAX_TOKENS = 3000

VIDEO_PATCH_SIZE = 56
VIDEO_MAX_FRAMES = 32
VIDEO_MAX_TOKENS = 4096

_EXPECTED = {
    "image": "a PNG, JPEG, GIF, WebP or BMP image",
    "audio": "a PCM WAV file (RIFF/WAVE)",
    "video": "an animated GIF (or an animated PNG/WebP)",
}
_DATA_URL_EXAMPLE = {
    "image": "data:image/png;base64,...",
    "audio": "data:audio/wav;base64,...",
    "video": "data:image/gif;base64,...",
}
_WHITESPACE = re.compile(r"\s+")


class MediaError(RequestValidationError):
    """A media item the server refuses with 400 (a ``RequestValidationError``). Its ``param``
    names the field and, when the field was a list, the index of the item: ``image_data[1]``;
    a field sent as a single string is named without an index (``audio_data``). The message
    says what is wrong and what was expected."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def image_tokens(width: int, height: int) -> int:
    """Placeholder tokens of a ``width`` x ``height`` image: ceil(width / 28) *
    ceil(height / 28), one token per 28 x 28 pixel patch, at least 1 and capped at 1024."""
    tokens = _ceil_div(width, IMAGE_PATCH_SIZE) * _ceil_div(height, IMAGE_PATCH_SIZE)
    return min(max(tokens, 1), IMAGE_MAX_TOKENS)


def audio_tokens(nframes: int, framerate: int) -> int:
    """Placeholder tokens of a clip of ``nframes`` frames at ``framerate`` Hz: ceil(seconds *
    25), one token per 40 ms (computed exactly, in integers, as ceil(nframes * 25 /
    framerate)), at least 1 and capped at 3000 per clip (two minutes)."""
    tokens = _ceil_div(nframes * AUDIO_TOKENS_PER_SECOND, framerate)
    return min(max(tokens, 1), AUDIO_MAX_TOKENS)


def video_tokens(n_frames: int, width: int, height: int) -> int:
    """Placeholder tokens of a ``n_frames``-frame ``width`` x ``height`` video: at most 32
    frames are sampled; min(n_frames, 32) * ceil(width / 56) * ceil(height / 56), one token per
    56 x 56 pixel patch of each sampled frame, at least 1 and capped at 4096 per video."""
    frames = min(n_frames, VIDEO_MAX_FRAMES)
    tokens = frames * _ceil_div(width, VIDEO_PATCH_SIZE) * _ceil_div(height, VIDEO_PATCH_SIZE)
    return min(max(tokens, 1), VIDEO_MAX_TOKENS)


def parse_media(
    image_data: str | Sequence[str] | None,
    audio_data: str | Sequence[str] | None,
    video_data: str | Sequence[str] | None,
) -> list[MediaItem]:
    """Decodes every item and counts its placeholder tokens.

    The result holds the images, then the audio clips, then the videos, each kind in the
    order it was given. Raises ``MediaError`` naming the field and index of the first bad item.
    """
    items: list[MediaItem] = []
    given: tuple[tuple[MediaKind, str | Sequence[str] | None], ...] = (
        ("image", image_data),
        ("audio", audio_data),
        ("video", video_data),
    )
    for kind, data in given:
        field = f"{kind}_data"
        for param, value in _entries(kind, field, data):
            raw = _decode_string(kind, param, value)
            items.append(MediaItem(kind=kind, num_tokens=_count_tokens(kind, param, raw)))
    return items


def expand_prompt(
    input_ids: list[int], items: list[MediaItem], media_token_ids: Mapping[str, int]
) -> list[int]:
    """Placeholder tokens go before the text: first every image, then every audio clip, then
    every video, each kind in the order of its list; each item contributes ``num_tokens``
    copies of its kind's token id. A tokenizer without the placeholder token of a kind that
    was given refuses the request (MediaError).

    ``input_ids`` is not changed; a new list is returned.
    """
    unknown = {item.kind for item in items} - set(MEDIA_KINDS)
    if unknown:
        kind = sorted(unknown)[0]
        raise MediaError(
            f"unknown media kind {kind!r}; expected one of {', '.join(MEDIA_KINDS)}", f"{kind}_data"
        )
    placeholders: list[int] = []
    for kind in MEDIA_KINDS:
        for item in items:
            if item.kind != kind:
                continue
            token_id = media_token_ids.get(kind)
            if token_id is None:
                raise MediaError(
                    f"this model's tokenizer has no <|{kind}|> placeholder token, so it cannot "
                    f"take {kind}_data; send the request without {kind}_data or serve a model "
                    "whose tokenizer has that token",
                    f"{kind}_data",
                )
            placeholders.extend([token_id] * item.num_tokens)
    return placeholders + list(input_ids)


def _entries(kind: str, field: str, data: object) -> list[tuple[str, object]]:
    """(param name, value) of each item of one field, with the count limit checked."""
    if data is None:
        return []
    if isinstance(data, str):
        return [(field, data)]
    if not isinstance(data, (list, tuple)):
        raise MediaError(
            f"{field} must be a string or a list of strings (raw base64 or "
            f"{_DATA_URL_EXAMPLE[kind]}), got {type(data).__name__}",
            field,
        )
    if len(data) > MAX_ITEMS_PER_KIND:
        raise MediaError(
            f"{field} has {len(data)} items; at most {MAX_ITEMS_PER_KIND} {kind} items are "
            "allowed per request",
            f"{field}[{MAX_ITEMS_PER_KIND}]",
        )
    return [(f"{field}[{i}]", value) for i, value in enumerate(data)]


def _decode_string(kind: str, param: str, value: object) -> bytes:
    """The bytes of one item: raw base64 (standard alphabet, RFC 4648 section 4; padding
    optional; whitespace ignored) or a ``data:`` URL whose header ends in ``;base64``. The
    media type a data URL declares is not trusted: the bytes decide what the item is. URLs
    (``http://``, ``https://``, ``file://``) and file paths are never fetched or opened; they
    are refused like any other string that is not base64."""
    expected = f"expected raw base64 or a base64 data URL such as {_DATA_URL_EXAMPLE[kind]}"
    if not isinstance(value, str):
        raise MediaError(
            f"{param} must be a string ({expected}), got {type(value).__name__}", param
        )
    if not value.strip():
        raise MediaError(f"{param} is empty; {expected}", param)
    payload = value
    if value[:5].lower() == "data:":
        header, comma, payload = value.partition(",")
        if not comma:
            raise MediaError(
                f"{param} is a data URL without a ',' before its data; {expected}", param
            )
        if not header.lower().endswith(";base64"):
            raise MediaError(
                f"{param} is a data URL that is not base64-encoded (no ';base64' before ','); "
                f"{expected}",
                param,
            )
    elif value.lstrip()[:8].lower().startswith(("http://", "https://", "file://")):
        raise MediaError(f"{param} is a URL; the server does not fetch URLs, {expected}", param)

    payload = _WHITESPACE.sub("", payload)
    if not payload:
        raise MediaError(f"{param} has no data after the data URL header; {expected}", param)
    # Refuse an oversized item before decoding it: base64 carries 3 bytes per 4 characters.
    if (len(payload) // 4) * 3 > MAX_ITEM_BYTES + 3:
        raise MediaError(_too_large(param, (len(payload) // 4) * 3), param)
    if len(payload) % 4 == 1:
        raise MediaError(
            f"{param} is not valid base64 (its length cannot be a base64 length); {expected}", param
        )
    payload += "=" * (-len(payload) % 4)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            f"{param} is not valid base64 (it has characters outside the standard base64 alphabet "
            f"or misplaced '=' padding; URLs and file paths are not read); {expected}",
            param,
        ) from None
    if len(raw) > MAX_ITEM_BYTES:
        raise MediaError(_too_large(param, len(raw)), param)
    if not raw:
        raise MediaError(f"{param} decodes to no bytes; {expected}", param)
    return raw


def _too_large(param: str, size: int) -> str:
    return (
        f"{param} is {size} bytes after decoding; at most {MAX_ITEM_BYTES} bytes "
        f"({MAX_ITEM_BYTES / 2**20:g} MiB) per item are allowed"
    )


def _count_tokens(kind: str, param: str, raw: bytes) -> int:
    if kind == "audio":
        return _audio(param, raw)
    width, height, n_frames = _image_header(kind, param, raw)
    if kind == "image":
        return image_tokens(width, height)
    return video_tokens(n_frames, width, height)


def _image_header(kind: str, param: str, raw: bytes) -> tuple[int, int, int]:
    """(width, height, frames) of an image file: a PNG, JPEG, GIF, WebP or BMP file, opened
    with Pillow. Only the header is read for the size (``Image.open(...).size``) and the file
    is checked with ``Image.verify()``, so the pixels are never decoded. ``verify()`` checks
    what a format allows without decoding (a PNG's chunks and their CRCs through IEND, so a
    PNG header followed by garbage is refused); it does not check a JPEG's compressed scan
    data.

    Frames are counted only for a video: an animated GIF, or any other multi-frame image of
    the formats above that Pillow opens (an animated PNG or WebP). The frame count is
    Pillow's ``n_frames``, the documented field; a still image counts as a one-frame video."""
    what = _EXPECTED[kind]
    try:
        with Image.open(BytesIO(raw), formats=IMAGE_FORMATS) as im:
            width, height = im.size
            fmt = im.format
            im.verify()
        n_frames = 1
        if kind == "video":
            # verify() leaves the image unusable; reopen to count the frames. For a GIF,
            # n_frames walks the frame headers without decoding any frame.
            with Image.open(BytesIO(raw), formats=IMAGE_FORMATS) as im:
                n_frames = int(getattr(im, "n_frames", 1))
    except Image.DecompressionBombError:
        raise MediaError(
            f"{param} declares too many pixels to be accepted; expected {what}", param
        ) from None
    except Image.UnidentifiedImageError:
        sniffed = _sniff(raw)
        if sniffed is not None:
            raise MediaError(
                f"{param} starts like a {sniffed} file but its header is broken; expected {what}",
                param,
            ) from None
        raise MediaError(
            f"{param} is not an image of an accepted format; expected {what}", param
        ) from None
    # Any failure of a parser of untrusted bytes means a bad file.
    except Exception as exc:  # noqa: BLE001
        raise MediaError(
            f"{param} is a broken or truncated image file ({_reason(exc)}); expected {what}", param
        ) from None
    if width <= 0 or height <= 0 or n_frames <= 0:
        raise MediaError(
            f"{param} is a {fmt} file of {width}x{height} pixels and {n_frames} frames; expected "
            f"{what} of at least 1x1 pixels",
            param,
        )
    return width, height, n_frames


def _sniff(raw: bytes) -> str | None:
    """The accepted format whose signature ``raw`` starts with, for a clearer message."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if raw.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if raw.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WebP"
    if raw.startswith(b"BM"):
        return "BMP"
    return None


def _audio(param: str, raw: bytes) -> int:
    """The placeholder tokens of a WAV file (RIFF/WAVE, uncompressed PCM, as the standard
    library's ``wave`` module reads it), whose sample data must be all present. Duration =
    nframes / framerate seconds."""
    what = _EXPECTED["audio"]
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise MediaError(
            f"{param} is not a WAV file (it does not start with a RIFF/WAVE header); expected "
            f"{what}",
            param,
        )
    try:
        with wave.open(BytesIO(raw), "rb") as w:
            nframes = w.getnframes()
            framerate = w.getframerate()
            frame_size = w.getsampwidth() * w.getnchannels()
            data = w.readframes(nframes)
    # Any failure of a parser of untrusted bytes means a bad file.
    except Exception as exc:  # noqa: BLE001
        raise MediaError(
            f"{param} is a broken or unsupported WAV file ({_reason(exc)}); expected {what}", param
        ) from None
    if framerate <= 0 or frame_size <= 0:
        raise MediaError(
            f"{param} is a WAV file with a sample rate of {framerate} Hz; expected {what}", param
        )
    if len(data) < nframes * frame_size:
        raise MediaError(
            f"{param} is a truncated WAV file: its header declares {nframes} frames but only "
            f"{len(data) // frame_size} are present; expected {what}",
            param,
        )
    return audio_tokens(nframes, framerate)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
