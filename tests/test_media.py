"""Images and audio in records (jobs/data/media.py, issue 46): the files a record names, each opened once on the
head, and every broken one named by file and line with the fix, in the preflight's one pass beside the text checks.
"""

from __future__ import annotations

import json
import wave

import pytest

from data.media import MediaCheck, MediaError, MediaRef, media_refs, open_clip, open_image
from data.render import RecordError
from tiny_assets import make_media, make_picture, make_tone


def parts(*content: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(content)},
                         {"role": "assistant", "content": [{"type": "text", "text": "a warm light"}]}]}  # fmt: skip


def test_a_record_names_its_pictures_and_clips_in_order_in_either_format():
    record = parts({"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
                   {"type": "audio", "path": "gs://b/c.wav"}, {"type": "image", "url": "d.jpg"})  # fmt: skip
    assert media_refs(record) == [MediaRef("image", "a.png", "turn 1's image 1"),
                                  MediaRef("audio", "gs://b/c.wav", "turn 1's audio 1"),
                                  MediaRef("image", "d.jpg", "turn 1's image 2")]  # fmt: skip
    # TRL's: placeholders, the files in the `images` column, in order (Arrow gives absent keys as None)
    trl = parts({"type": "image", "image": None}, {"type": "text", "text": "and"}, {"type": "image"}) | {
        "images": ["x.png", "y.png"]}  # fmt: skip
    assert [r.ref for r in media_refs(trl)] == ["x.png", "y.png"]
    assert media_refs({"messages": [{"role": "user", "content": "text only"}]}) == []
    with pytest.raises(RecordError, match=r"the images column holds 3 entries for 2 image parts"):
        media_refs(trl | {"images": ["x.png", "y.png", "z.png"]})
    with pytest.raises(RecordError, match=r"turn 1's audio 1 names no file"):
        media_refs(parts({"type": "audio"}))


def test_a_clip_the_audio_tower_cannot_hear_as_it_is_is_refused_with_the_fix(tmp_path):
    good = open_clip(make_tone(tmp_path / "ok.wav", 440).read_bytes())
    assert (good.sample_rate, good.channels, good.seconds) == (16_000, 1, 0.5) and 0.49 < good.peak < 0.51
    cases = {
        "is sampled at 44100 Hz; Gemma 4's feature extractor reads 16000 Hz": make_tone(tmp_path / "a.wav", 440,
                                                                                        rate=44_100),
        "has 2 channels": make_tone(tmp_path / "b.wav", 440, channels=2),
        "is silent (peak 0.0e+00": make_tone(tmp_path / "c.wav", 440, loudness=0),
        "is 31.0 s long; Gemma 4 hears the first 30 s": make_tone(tmp_path / "d.wav", 440, seconds=31),
        "holds no samples": make_tone(tmp_path / "e.wav", 440, seconds=0),
    }  # fmt: skip
    for message, path in cases.items():
        with pytest.raises(MediaError, match=message.replace("(", r"\(").replace("+", r"\+")):
            open_clip(path.read_bytes())
    with pytest.raises(MediaError, match=r"cannot be read as a PCM WAV file .*ffmpeg -i CLIP -ac 1 -ar 16000"):
        open_clip(b"ID3 an mp3, not a wav")


def test_every_sample_width_is_read_to_its_peak(tmp_path):
    import numpy as np

    for width, dtype in ((1, np.uint8), (2, "<i2"), (3, None), (4, "<i4")):
        full = 1 << (8 * width - 1)
        values = np.array([0, full // 2, -(full // 4)], dtype=np.int64)
        if width == 1:
            frames = (values + 128).astype(np.uint8).tobytes()
        elif width == 3:
            frames = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values)
        else:
            frames = values.astype(dtype).tobytes()
        with wave.open(str(tmp_path / f"w{width}.wav"), "wb") as clip:
            clip.setnchannels(1)
            clip.setsampwidth(width)
            clip.setframerate(16_000)
            clip.writeframes(frames)
        assert open_clip((tmp_path / f"w{width}.wav").read_bytes()).peak == pytest.approx(0.5), width


def test_a_picture_is_decoded_whole(tmp_path):
    data = make_picture(tmp_path / "p.png", (1, 2, 3), size=(40, 24)).read_bytes()
    assert (open_image(data).width, open_image(data).height) == (40, 24)
    with pytest.raises(MediaError, match="cannot be decoded as an image .*export it again as PNG or JPEG"):
        open_image(data[: len(data) // 2])  # truncated: only decoding it finds out
    with pytest.raises(MediaError, match="cannot be decoded as an image"):
        open_image(b"not a picture")


def test_each_file_is_opened_once_however_many_records_name_it(tmp_path, monkeypatch):
    import data.media as media

    make_media(tmp_path)
    opened = []
    read = media._read
    monkeypatch.setattr(media, "_read", lambda path: opened.append(path) or read(path))
    check, data_file = MediaCheck(), str(tmp_path / "media.jsonl")
    refs = [MediaRef("image", "media/red.png", "turn 1's image 1")]
    assert check.problems(refs * 3, data_file) == [] and check.problems(refs, data_file) == []
    assert opened == [str(tmp_path / "media" / "red.png")]


def test_a_gs_picture_and_clip_are_read_with_the_pods_credentials_and_a_missing_one_named(storage, metadata_server,
                                                                                         tmp_path):  # fmt: skip
    """gs:// files (absolute, or beside a gs:// data file) through gcsfs, on the emulator at 127.0.0.1."""
    from runtime.storage import gcs

    make_media(tmp_path)
    for name in ("red.png", "tone-440.wav"):
        gcs().pipe(f"demo-data/media/{name}", (tmp_path / "media" / name).read_bytes())
    refs = [MediaRef("image", "gs://demo-data/media/red.png", "turn 1's image 1"),
            MediaRef("audio", "media/tone-440.wav", "turn 1's audio 1")]  # fmt: skip
    assert MediaCheck().problems(refs, "gs://demo-data/captions.jsonl") == []
    (missing,) = MediaCheck().problems([MediaRef("image", "media/gone.png", "turn 2's image 1")],
                                       "gs://demo-data/captions.jsonl")  # fmt: skip
    assert missing.startswith("turn 2's image 1 'media/gone.png' is not there (gs://demo-data/media/gone.png)")


def test_the_preflight_names_every_broken_picture_and_clip_by_file_and_line_in_one_run(media_model, tmp_path, capsys):
    """A truncated picture, a silent clip, a file that is not a WAV, a missing file and a text record's own fault:
    all five named in one run, by the line an editor shows, before any worker (here: before any Ray) starts."""
    import ray_train_llm_finetune as ft

    make_media(tmp_path)
    media = tmp_path / "media"
    (media / "half.png").write_bytes((media / "red.png").read_bytes()[:60])
    make_tone(media / "quiet.wav", 440, loudness=0)
    (media / "notes.wav").write_text("not a wav")
    good = [json.loads(line) for line in (tmp_path / "media.jsonl").read_text().splitlines()]
    lines = [json.dumps(good[i % 4]) for i in range(12)]
    bad = {2: parts({"type": "image", "image": "media/half.png"}), 4: parts({"type": "audio", "audio": "media/quiet.wav"}),
           6: parts({"type": "audio", "audio": "media/notes.wav"}), 8: parts({"type": "image", "image": "media/gone.png"}),
           10: {"messages": [{"role": "user", "content": [{"type": "image", "image": "media/red.png"}]}]}}  # fmt: skip
    for i, record in bad.items():
        lines[i] = json.dumps(record)
    data = tmp_path / "captions.jsonl"
    data.write_text("\n".join(lines) + "\n")
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", str(media_model[0]), "--dataset", str(data),
            "--eval-split", "none", "--storage-path", str(tmp_path / "runs"), "--batch-size", "1", "--preflight"]  # fmt: skip
    assert ft.main(argv) == 2
    err = capsys.readouterr().err
    expected = [
        f"{data}, line 3: turn 1's image 1 'media/half.png' cannot be decoded as an image",
        f"{data}, line 5: turn 1's audio 1 'media/quiet.wav' is silent",
        f"{data}, line 7: turn 1's audio 1 'media/notes.wav' cannot be read as a PCM WAV file",
        f"{data}, line 9: turn 1's image 1 'media/gone.png' is not there ({media / 'gone.png'}); fix the path",
        f"{data}, line 11: the conversation has no assistant turn",
    ]
    assert "5 bad records:" in err and "Traceback" not in err, err
    at = [err.index(message) for message in expected]
    assert at == sorted(at)


def test_the_preflight_reports_the_media_and_refuses_a_model_that_cannot_read_them(tiny_assets, media_model, tmp_path,
                                                                                    capsys):  # fmt: skip
    """Good media records: the data report counts their pictures, clips and soft tokens, and names the modality the
    workers load; with a text-only model (no processor, no towers) the preflight refuses them, naming the model."""
    import ray_train_llm_finetune as ft

    argv = ["--backend", "cpu", "--num-workers", "1", "--dataset", str(make_media(tmp_path)), "--eval-split", "none",
            "--storage-path", str(tmp_path / "runs"), "--batch-size", "1", "--preflight"]  # fmt: skip
    assert ft.main([*argv, "--model", tiny_assets["model"]]) == 2
    err = capsys.readouterr().err
    assert f"records hold pictures or sound, but --model {tiny_assets['model']} has no processor to read them" in err
    assert ft.main([*argv, "--model", str(media_model[0]), "--recipe", "walkthrough"]) == 2
    assert "records hold pictures or sound, which only the chat template renders" in capsys.readouterr().err
    assert ft.main([*argv, "--model", str(media_model[0])]) == 0
    out = capsys.readouterr().out
    assert "media: 6 records hold 5 pictures (" in out and "and 3 clips (" in out and "modality image+audio" in out
    report = json.loads(out.rsplit("JOB_RESULT_JSON: ", 1)[1])["data_report"]
    media = report["train"]["media"]
    assert report["modality"] == "image+audio" and media["audio_tokens"] == 13 + 25 + 13  # clips of 0.5 s and 1 s


@pytest.fixture(scope="module")
def media_model(tmp_path_factory):
    from tiny_assets import make_media_model

    out = tmp_path_factory.mktemp("media-model")
    make_media(out)
    return make_media_model(out / "model"), out


def chat(image, clip, answer: str = "a warm small light") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "describe ."},
                                         {"type": "audio", "audio": clip}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip


def test_the_tiny_media_model_loads_as_gemma4_with_both_towers_and_its_processor_without_torchvision(media_model):
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from data.media import MediaCheck, media_refs
    from data.media_processor import MEDIA_TOKENS, load_media_processor
    from data.media_records import prepare_media_record

    model_dir, assets = media_model
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    assert {"vision_tower", "audio_tower", "language_model"} <= {n for n, _ in model.model.named_children()}
    processor = load_media_processor(str(model_dir))
    picture = Image.open(assets / "media" / "red.png").convert("RGB")
    with wave.open(str(assets / "media" / "tone-440.wav")) as clip:
        tone = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2").astype(np.float32) / 32768
    batch = processor.apply_chat_template([chat(picture, tone)], tokenize=True, return_dict=True, return_tensors="pt")
    ids = batch["input_ids"][0]
    tokenizer = processor.tokenizer
    # a 48x32 picture in at most 70 soft tokens of 3x3 pooled 4-pixel patches (the processor's own count), and a
    # clip of 0.5 s in ceil(500 / 40) tokens of 40 ms; the forward below checks each against its tower's output
    expected = processor._get_num_multimodal_tokens(image_sizes=[(32, 48)])["num_image_tokens"][0]
    assert 0 < int((ids == tokenizer.image_token_id).sum()) == expected <= 70
    assert int((ids == tokenizer.audio_token_id).sum()) == 13
    # the job's record with the prompt trained too (--prompt-loss): the soft tokens and their wrappers still are not
    record = {"messages": chat("media/red.png", "media/tone-440.wav")}
    refs, check = media_refs(record), MediaCheck()
    assert check.problems(refs, str(assets / "media.jsonl")) == []
    held = prepare_media_record(record, refs, check.contents(refs, str(assets / "media.jsonl")), tokenizer,
                                processor, prompt_loss=True)  # fmt: skip
    assert held.ids == ids.tolist()
    media = {tokenizer.convert_tokens_to_ids(getattr(tokenizer, name)) for name in MEDIA_TOKENS}
    assert [label == -100 for label in held.labels] == [token in media for token in held.ids]
    loss = model(**batch, labels=torch.tensor([held.labels])).loss
    assert torch.isfinite(loss)


def test_the_picture_and_the_clip_reach_the_model(media_model):
    """A record's media swapped with another's changes its loss: the towers' outputs are in the language model's
    inputs, not dropped on the way."""
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText

    from data.media import picture
    from data.media_processor import load_media_processor

    model_dir, assets = media_model
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    processor = load_media_processor(str(model_dir))
    red, blue = (picture((assets / "media" / name).read_bytes()) for name in ("red.png", "blue.jpg"))
    low, high = (np.sin(2 * np.pi * hz * np.arange(8000) / 16000).astype(np.float32) * 0.5 for hz in (440, 880))

    def loss(picture, clip) -> float:
        batch = processor.apply_chat_template([chat(picture, clip)], tokenize=True, return_dict=True,
                                              return_tensors="pt")  # fmt: skip
        with torch.no_grad():  # (the answer's tokens, the last five: the same in every call)
            labels = torch.full_like(batch["input_ids"], -100)
            labels[:, -5:] = batch["input_ids"][:, -5:]
            return float(model(**batch, labels=labels).loss)

    assert loss(red, low) == loss(red, low)
    assert loss(blue, low) != loss(red, low) and loss(red, high) != loss(red, low)


def test_a_picture_or_clip_replaced_under_its_name_is_prepared_again(tmp_path):
    """The prepared data's key holds every picture's and clip's content (and the model that read them): a file
    replaced under the same name makes a new key; the same files, the same key."""
    from data.prepared_key import media_fingerprint

    data = str(make_media(tmp_path))
    first = media_fingerprint([data], "model")
    assert first == media_fingerprint([data], "model") and len(first[0][2]) == 5  # three pictures, two clips
    make_picture(tmp_path / "media" / "red.png", (201, 30, 30))
    assert media_fingerprint([data], "model") != first
    make_tone(tmp_path / "media" / "tone-440.wav", 441)
    changed = media_fingerprint([data], "model")
    assert changed != first and media_fingerprint([data], "other model") != changed
    text = tmp_path / "text.jsonl"
    text.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    )
    assert media_fingerprint([str(text)], "model") == []  # text records: the key as before


def test_a_datasets_own_image_and_audio_columns_are_read_as_files_are(media_model, tmp_path, capsys):
    """TRL's format with the pictures in an `images` column of datasets' Image feature and the clips in an `audios`
    column of its Audio feature, as a hub dataset holds them (here a parquet file `datasets` wrote): decoded here
    (datasets would need soundfile for audio), checked as files are, and prepared; a truncated picture among them is
    named by its record and column entry."""
    from datasets import Audio, Dataset, Image, List

    import ray_train_llm_finetune as ft

    model_dir, assets = media_model
    red, tone = (assets / "media" / "red.png").read_bytes(), (assets / "media" / "tone-440.wav").read_bytes()

    def record(image: bytes, caption: str) -> dict:
        user = [{"type": "image"}, {"type": "text", "text": "describe it ."}, {"type": "audio"}]
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": [{"type": "text", "text": caption}]}],
                "images": [{"bytes": image, "path": None}], "audios": [{"bytes": tone, "path": "tone.wav"}]}  # fmt: skip

    def write(records: list[dict], name: str) -> str:
        data = Dataset.from_list(records).cast_column("images", List(Image())).cast_column("audios", List(Audio()))
        data.to_parquet(tmp_path / name)
        return str(tmp_path / name)

    argv = ["--backend", "cpu", "--num-workers", "1", "--model", str(model_dir), "--eval-split", "none",
            "--storage-path", str(tmp_path / "runs"), "--batch-size", "1", "--preflight"]  # fmt: skip
    good = write([record(red, "a warm small light")] * 4, "good.parquet")
    assert ft.main([*argv, "--dataset", good]) == 0
    report = json.loads(capsys.readouterr().out.rsplit("JOB_RESULT_JSON: ", 1)[1])["data_report"]
    assert report["modality"] == "image+audio"
    assert (report["train"]["media"]["images"], report["train"]["media"]["clips"]) == (4, 4)
    bad = write([record(red, "a warm small light"), record(red[:60], "a cold large water")], "bad.parquet")
    assert ft.main([*argv, "--dataset", bad]) == 2
    err = capsys.readouterr().err
    assert f"{bad}, record 2: turn 1's image 1 'images[0]' cannot be decoded as an image" in err


def pictures_of_every_mode(folder) -> dict[str, bool]:
    """Pictures of the modes users' files come in, under `folder`: {name: whether it carries an EXIF rotation}.
    Colours hide under the transparent pixels, so a picture read without laying it on white is another picture."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 4), dtype=np.uint8)
    rgba = Image.fromarray(pixels, "RGBA")
    rgba.save(folder / "rgba.png")
    Image.fromarray(pixels[..., [0, 3]], "LA").save(folder / "la.png")
    rgba.convert("RGB").quantize(16).save(folder / "p-transparent.png", transparency=3)  # a tRNS chunk
    Image.fromarray(pixels[..., 0], "L").save(folder / "grey.png")
    Image.fromarray(pixels[..., 0] > 128).save(folder / "bilevel.png")
    rgba.convert("CMYK").save(folder / "cmyk.jpg")
    rgba.convert("RGB").save(folder / "flat.jpg")
    for name, image, turn in (("phone.jpg", rgba.convert("RGB"), 6), ("turned.png", rgba, 3)):
        exif = image.getexif()
        exif[0x0112] = turn  # the EXIF orientation tag: rotate 90 degrees, 180 degrees
        image.save(folder / name, exif=exif)
    return {name: name in ("phone.jpg", "turned.png") for name in sorted(p.name for p in folder.iterdir())}


VLLM_LOADS = """
import json, sys
import numpy as np
from vllm.multimodal.media.image import ImageMediaIO

loader = ImageMediaIO(image_mode="RGB")  # as vLLM's MediaConnector loads a chat request's picture
for path in json.loads(sys.stdin.read()):
    np.save(path + ".vllm.npy", np.asarray(loader.load_bytes(open(path, "rb").read()).media))
"""


@pytest.mark.slow  # (vLLM's loader in the serving venv: a Python importing vLLM, ~8 s)
def test_a_picture_is_the_one_vllm_serves_and_transformers_processes_whatever_its_mode(tmp_path):
    """Every mode (transparent RGBA, LA and palette pictures, greyscale, bilevel, CMYK, JPEG) and EXIF orientation:
    the job's pixels are those vLLM 0.29's own loader gives the served model (run in the serving venv), and, for a
    picture without an EXIF rotation, those transformers' processor makes of the PIL image (TRL's format)."""
    import subprocess

    import numpy as np
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    from data.media import picture
    from infra.serving.rehearsal import ROOT, SERVE_PYTHON

    rotated = pictures_of_every_mode(tmp_path)
    paths = [str(tmp_path / name) for name in rotated]
    done = subprocess.run([str(SERVE_PYTHON), "-c", VLLM_LOADS], input=json.dumps(paths), text=True, cwd=ROOT,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    differs_from_plain_convert = []
    for name, turned in rotated.items():
        ours = np.asarray(picture((tmp_path / name).read_bytes()))
        np.testing.assert_array_equal(ours, np.load(tmp_path / f"{name}.vllm.npy"), err_msg=name)
        if not turned:
            np.testing.assert_array_equal(ours, convert_to_rgb(Image.open(tmp_path / name), return_numpy=True), name)
        plain = np.asarray(Image.open(tmp_path / name).convert("RGB"))
        differs_from_plain_convert += [name] if plain.shape != ours.shape or (plain != ours).any() else []
    assert differs_from_plain_convert == ["la.png", "p-transparent.png", "phone.jpg", "rgba.png", "turned.png"]


def test_a_deep_or_huge_picture_is_named_with_the_fix(tmp_path, monkeypatch):
    """A 16-bit greyscale PNG reads near-white on every path (refused, not trained as white), and one past PIL's
    decompression-bomb limit is a bad record, not a traceback."""
    import numpy as np
    from PIL import Image

    deep = tmp_path / "deep.png"
    Image.fromarray(np.arange(600, dtype=np.uint16).reshape(20, 30) * 97).save(deep)
    with pytest.raises(MediaError, match=r"is a 16-bit picture \(PIL mode I;16\).*save it with 8 bits a channel"):
        open_image(deep.read_bytes())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # (PIL refuses past twice this: 48 x 32 is past it)
    big = make_picture(tmp_path / "big.png", (1, 2, 3)).read_bytes()
    with pytest.raises(MediaError, match=r"is too large to open \(Image size \(1536 pixels\).*shrink it first"):
        open_image(big)


@pytest.fixture
def web(tmp_path):
    """A web server on 127.0.0.1 serving tmp_path/web: the base of its addresses."""
    import functools
    import http.server
    import threading

    (tmp_path / "web").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "web"))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_record_form_a_user_writes_is_read(media_model, tmp_path, web, capsys):
    """In one media file: text alone in parts, an http(s) `url` part (fetched, not joined onto the data file's
    folder), a data: URL, OpenAI's image_url part, a datasets Image entry by path alone; and their faults named by
    line in one run (an address that answers 404, a part that is neither text nor media)."""
    import base64

    import ray_train_llm_finetune as ft
    from data.media import media_refs

    model_dir, assets = media_model
    red = assets / "media" / "red.png"
    (tmp_path / "web" / "red.png").write_bytes(red.read_bytes())
    inline = "data:image/png;base64," + base64.b64encode(red.read_bytes()).decode()
    by_path = {"messages": parts({"type": "image"}, {"type": "text", "text": "describe it ."})["messages"],
               "images": [{"bytes": None, "path": str(red)}]}  # fmt: skip
    good = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe it ."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "a warm light"}]}]},
        parts({"type": "image", "url": f"{web}/red.png"}, {"type": "text", "text": "describe it ."}),
        parts({"type": "image", "image": inline}),
        parts({"type": "image_url", "image_url": {"url": f"{web}/red.png"}}),
        by_path,
    ]  # fmt: skip
    assert [r.ref for r in media_refs(by_path)] == [str(red)]
    data = tmp_path / "forms.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good))
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", str(model_dir), "--eval-split", "none",
            "--storage-path", str(tmp_path / "runs"), "--batch-size", "1", "--preflight"]  # fmt: skip
    assert ft.main([*argv, "--dataset", str(data)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "5 used" in out and "media: 4 records hold 4 pictures" in out
    bad = [parts({"type": "image", "url": f"{web}/gone.png"}), parts({"type": "video", "video": "clip.mp4"})]
    data.write_text("".join(json.dumps(r) + "\n" for r in [*good[:2], *bad]))
    assert ft.main([*argv, "--dataset", str(data)]) == 2
    err = capsys.readouterr().err
    assert "2 bad records:" in err and "Traceback" not in err, err
    assert (
        f"line 3: turn 1's image 1 '{web}/gone.png' cannot be fetched (HTTP 404 File not found); fix the address" in err
    )
    assert "line 4: turn 1's content's part 1 is 'video'; a part is text" in err
