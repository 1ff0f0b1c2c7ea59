"""How a vision-language family places an image in the token stream, and its pixel inputs.

An image travels as a uint8 H×W×3 array (envs/base.py) from the environment to the engine and, with
its trajectory, to the learner. The chat template renders one placeholder per image (Idefics3:
`<image>`; Qwen-VL: `<|vision_start|><|image_pad|><|vision_end|>`); `expand` replaces each
placeholder by the family's expansion (Idefics3: a wrapper token, `<global-img>`, `image_seq_len`
image tokens per tile, a wrapper token; Qwen-VL: `<|image_pad|>` once per merged patch, inside the
template's vision_start/end), exactly as the family's Hugging Face processor does, and `pixels`
builds the model's pixel inputs with the family's own image processor. The engine and the learner
both go through this module, so the learner sees exactly the token ids the engine saw; the token
ids of an episode are the expanded ones, and `collapse` gives back the one-placeholder form an
engine such as vLLM expands itself.

Design decisions:
- Expansion at the token level, from the processor's own string for the image (its
  `replace_image_token`), tokenised once: the placeholders are special tokens, so the expanded
  ids equal the processor's (tests/policy/test_vision.py and test_qwen_vl.py check them against it).
- Placeholder tokens are never sampled: `special_ids` names every token an expansion uses,
  and engines and the learner give them probability zero, so model text cannot open an image
  slot without an image (and an environment's text cannot either: `expand` checks that every
  placeholder has its image).
- One scheme per family, chosen by the config's `model_type` (`scheme_for`); text models have
  none. Families whose processors need torchvision are refused with a message that says so.
  Qwen-VL's combined processor wants a video processor (torchvision), so its scheme loads the
  tokenizer and the PIL image processor on their own (`load`).
- Positions: a family with multimodal rotary positions (Qwen-VL's M-RoPE, policy/mrope.py) has
  `positions`, the [3, T] position ids of a token list with its images; engines and the learner
  pass them to every forward (never the model's own cached `rope_deltas`). The others take 1-D
  positions 0, 1, 2, … as text does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


PIXEL_CACHE_BYTES = 64 << 20
"""Bytes of processed pixels a scheme keeps per process (least recently used dropped first)."""


class VisionError(ValueError):
    """An image or a placeholder that does not fit the model's scheme; the message says which."""


class ImageScheme(Protocol):
    """One family's placement of images in the token stream.

    Usage::

        scheme = scheme_for(model_path, tokenizer)        # None for a text model
        ids = expand(scheme, rendered_ids, images)         # what the engine and the learner see
        inputs = scheme.pixels([images_of_row_0, ...])     # model kwargs for those rows

    A family with multimodal rotary positions (Qwen-VL) also has `positions(ids, images)`: the
    position ids [3, len(ids)] of a token list holding the expansions of `images`, from 0
    (`batch_positions` builds a batch's).
    """

    image_token_id: int
    """The token an expansion repeats (the image's features go in its slots)."""
    placeholder: tuple[int, ...]
    """The tokens the chat template renders for one image."""
    special_ids: tuple[int, ...]
    """Every token an expansion uses: never sampled."""

    def expansion(self, image: np.ndarray) -> list[int]:
        """The token ids that replace one placeholder for `image`."""
        ...

    def pixels(self, rows: Sequence[Sequence[np.ndarray]], device: Any = "cpu") -> dict:
        """Model inputs (pixel_values, ...) for the images of each row, in order; {} without any."""
        ...


def expand(scheme: ImageScheme, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[int]:
    """`ids` (rendered by the chat template) with the i-th placeholder replaced by the expansion
    of `images[i]`; VisionError unless there is exactly one placeholder per image and no other
    token of an expansion appears outside one."""
    out: list[int] = []
    at, i, ids = 0, 0, list(ids)
    place, special = list(scheme.placeholder), set(scheme.special_ids)
    while i < len(ids):
        if ids[i:i + len(place)] == place:
            if at == len(images):
                raise VisionError(f"the rendered messages hold more image placeholders than their {len(images)} "
                                  "image(s): text must not contain the image token")
            out += scheme.expansion(images[at])
            at += 1
            i += len(place)
        elif ids[i] in special:
            raise VisionError("the rendered messages hold an image token outside an image's placeholder: "
                              "text must not contain image tokens")
        else:
            out.append(ids[i])
            i += 1
    if at != len(images):
        raise VisionError(f"the messages hold {len(images)} image(s) but their rendering has {at} placeholder(s): "
                          "the chat template must render each image part as the image token")
    return out


def collapse(scheme: ImageScheme, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[int]:
    """The inverse of `expand`: each image's expansion in `ids`, in order, back to one
    placeholder (the prompt form of engines that expand placeholders themselves)."""
    out, i, ids = [], 0, list(ids)
    for image in images:
        exp = scheme.expansion(image)
        j = _find(ids, exp, i)
        if j < 0:
            raise VisionError("an image's expansion is missing from the token ids: they were not made by expand")
        out += ids[i:j] + list(scheme.placeholder)
        i = j + len(exp)
    return out + ids[i:]


def image_tokens(scheme: ImageScheme, image: np.ndarray) -> int:
    """How many `image_token_id` tokens the expansion of `image` holds (an engine's count of the
    images a row's cached tokens already hold)."""
    return scheme.expansion(image).count(scheme.image_token_id)


def image_key(image: np.ndarray) -> str:
    """A content hash of `image` (its size and pixels): engines key their caches on it."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(image.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(image).tobytes())
    return h.hexdigest()


class _PixelCache:
    """An image processor's output per image, keyed by content, at most PIXEL_CACHE_BYTES of
    tensors (least recently used dropped first): the learner scores each picture in several
    passes a step, and the processor is the slow part. Every scheme keeps its pixels in one."""

    def __init__(self, process) -> None:
        self.process = process  # image -> a tuple of tensors and plain values
        self.items: OrderedDict[str, tuple] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def _size(value: tuple) -> int:
        return sum(t.numel() * t.element_size() for t in value if hasattr(t, "element_size"))

    def __call__(self, image: np.ndarray) -> tuple:
        key = image_key(image)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.process(image)
        size = self._size(value)
        if size <= PIXEL_CACHE_BYTES:
            self.items[key] = value
            self.bytes += size
            while self.bytes > PIXEL_CACHE_BYTES:
                _, old = self.items.popitem(last=False)
                self.bytes -= self._size(old)
        return value


def _find(seq: list[int], sub: list[int], start: int) -> int:
    first, n = sub[0], len(sub)
    for j in range(start, len(seq) - n + 1):
        if seq[j] == first and seq[j:j + n] == sub:
            return j
    return -1


class Idefics3Scheme:
    """Idefics3 (and SmolVLM): `<fake_token_around_image><global-img>` + `<image>` × image_seq_len
    + `<fake_token_around_image>` per image, with row/column tiles before it when the image
    processor splits images."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.image_processor = processor.image_processor
        tok = processor.tokenizer
        self.image_token_id = processor.image_token_id
        self.placeholder = (self.image_token_id,)
        names = [processor.fake_image_token, processor.image_token, processor.global_image_tag]
        names += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
        ids = [tok.convert_tokens_to_ids(n) for n in names]
        self.special_ids = tuple(sorted({i for i in ids if i is not None and i != tok.unk_token_id}))
        self._tok = tok
        self._cache: dict[tuple[int, int], list[int]] = {}
        self._tiles = _PixelCache(self._process)

    @classmethod
    def load(cls, path: str) -> Idefics3Scheme:
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(path))

    def expansion(self, image: np.ndarray) -> list[int]:
        h, w = image.shape[:2]
        if (h, w) not in self._cache:  # the expansion depends on the image's size only
            inputs = self.image_processor([[image]], return_row_col_info=True)
            text = self.processor.replace_image_token(inputs, 0)
            self._cache[(h, w)] = list(self._tok(text, add_special_tokens=False)["input_ids"])
        return list(self._cache[(h, w)])

    def _process(self, image: np.ndarray) -> tuple:
        """(pixel_values [tiles, C, H, W], pixel_attention_mask [tiles, H, W]) of one image."""
        direct = self._direct(image)
        if direct is not None:
            return direct
        out = self.image_processor([[image]], return_tensors="pt")
        return out["pixel_values"][0], out["pixel_attention_mask"][0]

    def _direct(self, image: np.ndarray):
        """The image processor's output for `image` computed in numpy, where the processor only
        rescales and normalises (with its own functions): no tiles, and a picture already of the
        vision encoder's size, so its resizes are the identity (the built-in model's 64×64
        pictures; tests pin the result to the processor's). None elsewhere. A step of the image
        maze processes about a thousand new pictures, and the processor's PIL round trip is most
        of their cost."""
        import torch

        ip = self.image_processor
        side = ip.max_image_size["longest_edge"]
        if (ip.do_image_splitting or image.shape != (side, side, 3) or image.dtype != np.uint8
                or ip.size.get("longest_edge") != side):
            return None
        x = np.ascontiguousarray(image.transpose(2, 0, 1))  # [C, H, W], as the processor holds it
        if ip.do_rescale:
            x = ip.rescale(x, ip.rescale_factor)
        if ip.do_normalize:
            x = ip.normalize(x, ip.image_mean, ip.image_std)
        values = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]  # [1, C, H, W]
        return values, torch.ones((1, side, side), dtype=torch.long)

    def pixels(self, rows: Sequence[Sequence[np.ndarray]], device: Any = "cpu") -> dict:
        import torch

        per_row = []
        for images in rows:
            tiles = [self._tiles(img) for img in images]
            per_row.append(([v for v, _ in tiles], [m for _, m in tiles]))
        if not any(values for values, _ in per_row):
            return {}
        flat = [v for values, _ in per_row for v in values]
        n = max(sum(v.shape[0] for v in values) for values, _ in per_row)
        c, h, w = flat[0].shape[1], max(v.shape[2] for v in flat), max(v.shape[3] for v in flat)
        # Zero images are padding to Idefics3 (dropped before its vision tower): real ones never
        # normalise to all zeros from uint8 pixels.
        pv = torch.zeros((len(rows), n, c, h, w), dtype=flat[0].dtype)
        pm = torch.zeros((len(rows), n, h, w), dtype=torch.long)
        for r, (values, masks) in enumerate(per_row):
            k = 0
            for v, m in zip(values, masks):
                pv[r, k:k + v.shape[0], :, :v.shape[2], :v.shape[3]] = v
                pm[r, k:k + m.shape[0], :m.shape[1], :m.shape[2]] = m
                k += v.shape[0]
        return {"pixel_values": pv.to(device), "pixel_attention_mask": pm.to(device)}


class QwenVLScheme:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the template renders `<|vision_start|><|image_pad|>
    <|vision_end|>` per image; the processor repeats `<|image_pad|>` grid_h·grid_w / merge² times
    (the image resized to a multiple of patch·merge, in patches of `patch_size`). Pixel inputs are
    every patch of the rows' images, concatenated ([patches, C·temporal·patch²]), and each image's
    (t, h, w) grid; positions are M-RoPE's (policy/mrope.py)."""

    def __init__(self, tokenizer, image_processor) -> None:
        self.image_processor = image_processor
        self.merge = image_processor.merge_size
        ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
               for name in ("vision_start", "image_pad", "vision_end", "video_pad", "vision_pad")}
        ids = {k: v for k, v in ids.items() if v is not None and v != tokenizer.unk_token_id}
        if not {"vision_start", "image_pad", "vision_end"} <= set(ids):
            raise VisionError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} lacks Qwen-VL's image tokens "
                              "<|vision_start|>, <|image_pad|>, <|vision_end|>")
        self.image_token_id = ids["image_pad"]
        self.placeholder = (ids["vision_start"], ids["image_pad"], ids["vision_end"])
        self.special_ids = tuple(sorted(set(ids.values())))
        self._grids: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._processed = _PixelCache(self._process)

    @classmethod
    def load(cls, path: str) -> QwenVLScheme:
        """The tokenizer and the PIL image processor on their own: the family's combined processor
        wants a video processor, which needs torchvision."""
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return cls(AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path))

    def _process(self, image: np.ndarray):
        """(patches [n, D], grid (t, h, w)) of one image."""
        out = self.image_processor([image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        self._grids[image.shape[:2]] = grid
        return out["pixel_values"], grid

    def grid(self, image: np.ndarray) -> tuple[int, int, int]:
        """The image's (t, h, w) grid of patches (it depends on the image's size only)."""
        if image.shape[:2] not in self._grids:
            self._processed(image)
        return self._grids[image.shape[:2]]

    def expansion(self, image: np.ndarray) -> list[int]:
        t, h, w = self.grid(image)
        start, pad, end = self.placeholder
        return [start] + [pad] * (t * h * w // self.merge ** 2) + [end]

    def pixels(self, rows: Sequence[Sequence[np.ndarray]], device: Any = "cpu") -> dict:
        import torch

        done = [self._processed(img) for images in rows for img in images]
        if not done:
            return {}
        return {"pixel_values": torch.cat([p for p, _ in done]).to(device),
                "image_grid_thw": torch.tensor([g for _, g in done], dtype=torch.long, device=device)}

    def positions(self, ids: Sequence[int], images: Sequence[np.ndarray]):
        from policy.mrope import mrope_positions

        return mrope_positions(ids, self.image_token_id, [self.grid(img) for img in images], self.merge)


def batch_positions(scheme: ImageScheme | None, tokens, lengths: Sequence[int],
                    images: Sequence[Sequence[np.ndarray]]):
    """Position ids [3, B, T] of right-padded rows `tokens` [B, T] (row r's first `lengths[r]`
    tokens holding the expansions of `images[r]`; padding positions 0), for a family with
    `positions`; None for the others (their 1-D positions are the model's default)."""
    import torch

    if scheme is None or not hasattr(scheme, "positions"):
        return None
    out = torch.zeros((3, *tokens.shape), dtype=torch.long)
    for r, (n, imgs) in enumerate(zip(lengths, images)):
        out[:, r, :n] = scheme.positions(tokens[r, :n].tolist(), imgs)
    return out.to(tokens.device)


SCHEMES = {"idefics3": Idefics3Scheme, "smolvlm": Idefics3Scheme,
           "qwen2_vl": QwenVLScheme, "qwen2_5_vl": QwenVLScheme, "qwen3_vl": QwenVLScheme}
"""Vision-language families by config `model_type`."""


def is_vision(config) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def scheme_for(path: str, config=None) -> ImageScheme | None:
    """The image scheme of the model at `path` (None for a text model); VisionError for a
    vision-language family Tandem cannot place images for."""
    from transformers import AutoConfig

    config = config if config is not None else AutoConfig.from_pretrained(path)
    if not is_vision(config):
        return None
    family = config.model_type
    if family not in SCHEMES:
        raise VisionError(f"{path}: Tandem does not place images for the {family!r} family yet; it does for "
                          f"{', '.join(sorted(SCHEMES))}")
    try:
        return SCHEMES[family].load(path)
    except VisionError:
        raise
    except Exception as exc:
        raise VisionError(f"{path}: cannot load its processor ({type(exc).__name__}: {exc}); a vision-language "
                          "model directory holds its processor's files beside the weights") from exc
