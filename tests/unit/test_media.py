"""Media decoding and placeholder counts (``tokenizer_proc/media.py``), on real files built here."""

from __future__ import annotations

import base64
import io
import math
import struct
import wave

import pytest
from PIL import Image

from pipeline.io_struct import MediaItem
from tokenizer_proc import media
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.media import MediaError, expand_prompt, parse_media

MEDIA_IDS = {"image": 901, "audio": 902, "video": 903}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 20, 30)).save(buf, "JPEG")
    return buf.getvalue()


def gif(width: int, height: int, frames: int) -> bytes:
    images = [
        Image.new("RGB", (width, height), (i * 7 % 256, 40, 200 - i % 200)) for i in range(frames)
    ]
    buf = io.BytesIO()
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=40, loop=0)
    return buf.getvalue()


def wav(seconds: float, rate: int = 16000, channels: int = 1, sampwidth: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(sampwidth)
        w.setframerate(rate)
        w.writeframes(b"\x00" * (round(seconds * rate) * channels * sampwidth))
    return buf.getvalue()


def error_of(**kwargs: object) -> MediaError:
    args = {"image_data": None, "audio_data": None, "video_data": None}
    args.update(kwargs)
    with pytest.raises(MediaError) as info:
        parse_media(**args)  # type: ignore[arg-type]
    return info.value


# --- images -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [(100, 60, 12), (28, 28, 1), (29, 28, 2), (1, 1, 1), (224, 224, 64), (640, 480, 23 * 18)],
)
def test_image_tokens_are_28px_patches(width: int, height: int, tokens: int) -> None:
    assert tokens == math.ceil(width / 28) * math.ceil(height / 28)
    assert parse_media(b64(png(width, height)), None, None) == [MediaItem("image", tokens)]


def test_image_raw_base64_and_data_url_agree() -> None:
    data = png(100, 60)
    items = parse_media(
        [b64(data), data_url("image/png", data), "DATA:image/png;BASE64," + b64(data)], None, None
    )
    assert items == [MediaItem("image", 12)] * 3


def test_image_base64_with_line_breaks_and_no_padding() -> None:
    encoded = b64(png(30, 30))
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert parse_media([wrapped, encoded.rstrip("=")], None, None) == [MediaItem("image", 4)] * 2


def test_image_jpeg_and_declared_type_is_not_trusted() -> None:
    # The data URL says PNG; the bytes are a JPEG. The bytes decide.
    assert parse_media(data_url("image/png", jpeg(57, 10)), None, None) == [MediaItem("image", 3)]


def test_image_cap() -> None:
    # 2000 x 2000 is 72 * 72 = 5184 patches: capped.
    assert parse_media(b64(png(2000, 2000)), None, None) == [
        MediaItem("image", media.IMAGE_MAX_TOKENS)
    ]
    assert media.IMAGE_MAX_TOKENS == 1024
    assert media.image_tokens(28 * 32, 28 * 32) == 1024
    assert media.image_tokens(28 * 32 + 1, 28 * 32) == 1024


# --- audio --------------------------------------------------------------------------------------


def test_audio_one_second_16khz_mono_is_25_tokens() -> None:
    data = wav(1.0)
    assert parse_media(None, b64(data), None) == [MediaItem("audio", 25)]
    assert parse_media(None, [data_url("audio/wav", data)], None) == [MediaItem("audio", 25)]


@pytest.mark.parametrize(
    ("seconds", "rate", "channels", "tokens"),
    [
        (0.04, 16000, 1, 1),
        (0.041, 16000, 1, 2),
        (2.5, 8000, 2, 63),
        (0.0, 16000, 1, 1),
        (0.1, 44100, 1, 3),
    ],
)
def test_audio_one_token_per_40ms(seconds: float, rate: int, channels: int, tokens: int) -> None:
    assert parse_media(None, b64(wav(seconds, rate, channels)), None) == [
        MediaItem("audio", tokens)
    ]


def test_audio_cap() -> None:
    # 130 s at 1 kHz 8-bit: 3250 tokens before the cap, 130 KB of samples.
    assert parse_media(None, b64(wav(130.0, rate=1000, sampwidth=1)), None) == [
        MediaItem("audio", 3000)
    ]
    assert media.audio_tokens(120 * 16000, 16000) == 3000


def test_audio_refuses_non_wav_and_truncated_wav() -> None:
    err = error_of(audio_data=[b64(wav(0.5)), b64(png(10, 10))])
    assert err.param == "audio_data[1]"
    assert "WAV" in str(err) and "RIFF" in str(err)

    truncated = wav(1.0)[:2000]  # the header declares 16000 frames
    err = error_of(audio_data=b64(truncated))
    assert err.param == "audio_data"
    assert "truncated" in str(err)

    # A RIFF/WAVE header and nothing usable after it.
    err = error_of(audio_data=b64(b"RIFF\x24\x00\x00\x00WAVEjunkjunkjunkjunk"))
    assert err.param == "audio_data"


def test_audio_refuses_non_pcm_wav() -> None:
    # A float (format 3) WAV: the stdlib wave module does not read it.
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    data = b"\x00" * 400
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
    err = error_of(audio_data=[b64(b"RIFF" + struct.pack("<I", len(body)) + body)])
    assert err.param == "audio_data[0]"
    assert "WAV" in str(err)


# --- video --------------------------------------------------------------------------------------


def test_video_three_frame_gif() -> None:
    data = gif(100, 60, 3)
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 3
    # 3 frames * ceil(100/56) * ceil(60/56) = 3 * 2 * 2
    assert parse_media(None, None, b64(data)) == [MediaItem("video", 12)]
    assert parse_media(None, None, [data_url("image/gif", data)]) == [MediaItem("video", 12)]


def test_video_frames_sampled_at_most_32_and_cap() -> None:
    assert parse_media(None, None, b64(gif(56, 56, 40))) == [MediaItem("video", 32)]
    # 32 frames * 3 * 3 = 288; 32 * 12 * 12 = 4608 -> capped at 4096.
    assert parse_media(None, None, b64(gif(150, 150, 33))) == [MediaItem("video", 288)]
    assert media.video_tokens(32, 56 * 12, 56 * 12) == 4096


def test_video_still_image_is_one_frame() -> None:
    assert parse_media(None, None, b64(png(112, 56))) == [MediaItem("video", 2)]


# --- ordering of parse_media --------------------------------------------------------------------


def test_parse_media_order_is_kind_then_item() -> None:
    items = parse_media(
        [b64(png(28, 28)), b64(png(56, 28))],
        b64(wav(1.0)),
        [b64(gif(56, 56, 2))],
    )
    assert items == [
        MediaItem("image", 1),
        MediaItem("image", 2),
        MediaItem("audio", 25),
        MediaItem("video", 2),
    ]
    assert parse_media(None, None, None) == []
    assert parse_media([], [], []) == []


# --- refusals -----------------------------------------------------------------------------------


def test_media_error_is_a_request_validation_error() -> None:
    err = MediaError("bad", "image_data[0]")
    assert isinstance(err, RequestValidationError)
    assert isinstance(err, ValueError)
    assert err.param == "image_data[0]"
    assert str(err) == "bad"


def test_malformed_base64_names_the_index() -> None:
    err = error_of(image_data=[b64(png(10, 10)), "not base64 at all!!"])
    assert err.param == "image_data[1]"
    assert "base64" in str(err) and "data:image/png;base64," in str(err)

    err = error_of(image_data=[b64(png(10, 10)), "data:image/png;base64,@@@@"])
    assert err.param == "image_data[1]"

    err = error_of(image_data="abcde")  # a length no base64 text can have
    assert err.param == "image_data"


def test_png_header_followed_by_garbage() -> None:
    good = png(100, 60)
    for bad in (good[:8] + b"garbage!" * 20, good[:33] + b"\x00garbage" * 20, good[:-6]):
        err = error_of(image_data=[b64(good), b64(bad)])
        assert err.param == "image_data[1]"
        assert "PNG" in str(err)


def test_not_an_image() -> None:
    err = error_of(image_data=b64(b"hello, this is plain text"))
    assert err.param == "image_data"
    assert "image" in str(err)
    err = error_of(video_data=[b64(wav(0.1))])
    assert err.param == "video_data[0]"


def test_empty_and_non_string_items() -> None:
    assert error_of(image_data="").param == "image_data"
    assert error_of(audio_data=[b64(wav(0.1)), "   "]).param == "audio_data[1]"
    assert error_of(image_data="data:image/png;base64,").param == "image_data"
    err = error_of(image_data=[b64(png(10, 10)), 42])
    assert err.param == "image_data[1]"
    assert "string" in str(err) and "int" in str(err)
    assert error_of(video_data=[None]).param == "video_data[0]"
    assert error_of(image_data=123).param == "image_data"


def test_data_url_must_be_base64_and_urls_are_not_fetched() -> None:
    err = error_of(image_data=["data:image/png,rawbytes"])
    assert err.param == "image_data[0]" and "base64" in str(err)
    err = error_of(image_data=["data:image/png;base64"])
    assert err.param == "image_data[0]"
    err = error_of(image_data=["https://example.com/cat.png"])
    assert err.param == "image_data[0]" and "URL" in str(err)


def test_too_many_items() -> None:
    one = b64(png(10, 10))
    assert len(parse_media([one] * 16, None, None)) == 16
    err = error_of(image_data=[one] * 17)
    assert err.param == "image_data[16]"
    assert "16" in str(err) and "17" in str(err)
    assert error_of(audio_data=[b64(wav(0.1))] * 17).param == "audio_data[16]"


def test_item_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    assert media.MAX_ITEM_BYTES == 20 * 1024 * 1024
    # Refused from its base64 length, before decoding.
    huge = "A" * (media.MAX_ITEM_BYTES // 3 * 4 + 8)
    err = error_of(image_data=[b64(png(10, 10)), huge])
    assert err.param == "image_data[1]"
    assert "20 MiB" in str(err)
    # And on the decoded length, with a lowered limit.
    data = png(100, 60)
    monkeypatch.setattr(media, "MAX_ITEM_BYTES", len(data) - 1)
    assert error_of(image_data=b64(data)).param == "image_data"
    monkeypatch.setattr(media, "MAX_ITEM_BYTES", len(data))
    assert parse_media(b64(data), None, None) == [MediaItem("image", 12)]


# --- expand_prompt ------------------------------------------------------------------------------


def test_expand_prompt_puts_placeholders_first_in_documented_order() -> None:
    input_ids = [5, 6, 7]
    # Deliberately out of kind order: expand_prompt orders by kind, then by item order.
    items = [
        MediaItem("video", 2),
        MediaItem("image", 3),
        MediaItem("audio", 1),
        MediaItem("image", 2),
    ]
    expanded = expand_prompt(input_ids, items, MEDIA_IDS)
    assert expanded == [901] * 5 + [902] + [903] * 2 + input_ids
    assert sum(item.num_tokens for item in items) == len(expanded) - len(input_ids)
    assert input_ids == [5, 6, 7]


def test_expand_prompt_with_parsed_media() -> None:
    items = parse_media([b64(png(100, 60)), b64(png(28, 28))], b64(wav(1.0)), b64(gif(100, 60, 3)))
    expanded = expand_prompt([1, 2], items, MEDIA_IDS)
    assert expanded == [901] * 13 + [902] * 25 + [903] * 12 + [1, 2]
    assert sum(item.num_tokens for item in items) == len(expanded) - 2


def test_expand_prompt_without_media_and_missing_token() -> None:
    assert expand_prompt([1, 2, 3], [], {}) == [1, 2, 3]
    assert expand_prompt([1], [MediaItem("image", 2)], {"image": 9}) == [9, 9, 1]
    with pytest.raises(MediaError) as info:
        expand_prompt([1], [MediaItem("image", 1), MediaItem("audio", 1)], {"image": 9})
    assert info.value.param == "audio_data"
    assert "<|audio|>" in str(info.value)


def test_shipped_tokenizer_has_media_tokens() -> None:
    from pipeline.tokenizer_loader import load_tokenizer

    ids = load_tokenizer(None).media_token_ids
    assert set(ids) == {"image", "audio", "video"}
    # 56x28 image: 2 tokens; 80 ms of audio: 2 tokens; 2 frames of 56x56: 2 tokens.
    items = parse_media(b64(png(56, 28)), b64(wav(0.08)), b64(gif(56, 56, 2)))
    expanded = expand_prompt([1], items, ids)
    assert expanded == [ids["image"]] * 2 + [ids["audio"]] * 2 + [ids["video"]] * 2 + [1]
