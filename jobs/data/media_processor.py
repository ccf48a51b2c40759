"""Gemma 4's processor for pictures and sound (the preparation's: data/media_records.py; the export's).

transformers 5.23's `Gemma4Processor` takes a video processor too, whose class needs torchvision; torchvision does
not import beside the CPU build of torch this project pins (torch 2.13.0+cpu: PyPI's torchvision links CUDA's
libtorch, "operator torchvision::nms does not exist"), and TorchTPU's base image brings its own torch.
`MediaProcessor` is Gemma4Processor without the video processor (ProcessorMixin takes its sub-processors from
`__init__`'s parameters: processing_utils.get_attributes), with its own image and audio expansion unchanged: the same
soft tokens, pixel values and audio features.

What it saves is Gemma4Processor's: `processor_class` "Gemma4Processor" (a class every transformers has, so
`AutoProcessor.from_pretrained` builds the real one wherever torchvision imports, and fails loudly, naming the
video processor, where it does not, instead of returning the tokenizer alone as it does for a class it does not
know), with its fields (image_seq_length, audio_seq_length, audio_ms_per_token). An export carries its base's
processor files as they are (checkpoints.save_processor), so it loads as the base loads.
"""

from __future__ import annotations

import json
import os

from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
from transformers.processing_utils import ProcessorMixin

# The soft tokens' wrappers, as Gemma 4's tokenizer names them (tokenizer.image_token and so on)
MEDIA_TOKENS = ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token")
PROCESSOR_CONFIG = "processor_config.json"
FIELDS = ("image_seq_length", "audio_seq_length", "audio_ms_per_token")  # Gemma4Processor.__init__'s own


class MediaProcessor(Gemma4Processor):
    """Gemma4Processor's pictures and sound, without video (module docstring)."""

    def __init__(self, feature_extractor, image_processor, tokenizer, chat_template=None, image_seq_length: int = 280,
                 audio_seq_length: int = 750, audio_ms_per_token: int = 40, **kwargs):  # fmt: skip
        # Gemma4Processor.__init__'s fields (processing_gemma4.py), less the video ones it cannot build here
        self.image_seq_length, self.audio_seq_length = image_seq_length, audio_seq_length
        self.audio_ms_per_token = audio_ms_per_token
        self.image_token, self.image_token_id = tokenizer.image_token, tokenizer.image_token_id
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        self.audio_token, self.audio_token_id = tokenizer.audio_token, tokenizer.audio_token_id
        self.boa_token, self.eoa_token = tokenizer.boa_token, tokenizer.eoa_token
        self.video_token = self.video_token_id = None
        ProcessorMixin.__init__(self, feature_extractor=feature_extractor, image_processor=image_processor,
                                tokenizer=tokenizer, chat_template=chat_template, **kwargs)  # fmt: skip

    def to_dict(self) -> dict:
        """As Gemma4Processor saves itself (module docstring): its class name, its fields."""
        return super().to_dict() | {"processor_class": Gemma4Processor.__name__} | {f: getattr(self, f) for f in FIELDS}


def load_media_processor(model: str) -> MediaProcessor:
    """The processor saved beside a model (processor_config.json, the tokenizer, the chat template)."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model)
    saved = os.path.join(model, PROCESSOR_CONFIG)
    fields = json.loads(open(saved).read()) if os.path.isfile(saved) else {}
    return MediaProcessor(Gemma4AudioFeatureExtractor.from_pretrained(model),
                          Gemma4ImageProcessorPil.from_pretrained(model), tokenizer, tokenizer.chat_template,
                          **{f: fields[f] for f in FIELDS if f in fields})  # fmt: skip
