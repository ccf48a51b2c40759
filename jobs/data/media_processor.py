"""Gemma 4's processor for pictures and sound (the preparation's: data/media_records.py; the export's).

transformers 5.23's `Gemma4Processor` takes a video processor too, whose class needs torchvision; torchvision does
not import beside the CPU build of torch this project pins (torch 2.13.0+cpu: "operator torchvision::nms does not
exist"), and TorchTPU's base image brings its own torch. `MediaProcessor` is Gemma4Processor without the video
processor (ProcessorMixin takes its sub-processors from `__init__`'s parameters: processing_utils.get_attributes),
with its own image and audio expansion unchanged: the same soft tokens, pixel values and audio features.
"""

from __future__ import annotations

from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
from transformers.processing_utils import ProcessorMixin

# The soft tokens' wrappers, as Gemma 4's tokenizer names them (tokenizer.image_token and so on)
MEDIA_TOKENS = ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token")


class MediaProcessor(Gemma4Processor):
    """Gemma4Processor's pictures and sound, without video (module docstring)."""

    def __init__(self, feature_extractor, image_processor, tokenizer, chat_template=None, **kwargs):
        # Gemma4Processor.__init__'s fields (processing_gemma4.py), less the video ones it cannot build here
        self.image_seq_length = kwargs.pop("image_seq_length", 280)
        self.audio_seq_length = kwargs.pop("audio_seq_length", 750)
        self.audio_ms_per_token = kwargs.pop("audio_ms_per_token", 40)
        self.image_token, self.image_token_id = tokenizer.image_token, tokenizer.image_token_id
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        self.audio_token, self.audio_token_id = tokenizer.audio_token, tokenizer.audio_token_id
        self.boa_token, self.eoa_token = tokenizer.boa_token, tokenizer.eoa_token
        self.video_token = self.video_token_id = None
        ProcessorMixin.__init__(self, feature_extractor=feature_extractor, image_processor=image_processor,
                                tokenizer=tokenizer, chat_template=chat_template, **kwargs)  # fmt: skip


def load_media_processor(model: str) -> MediaProcessor:
    """The processor saved beside a model (processor_config.json, the tokenizer, the chat template)."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model)
    return MediaProcessor(Gemma4AudioFeatureExtractor.from_pretrained(model),
                          Gemma4ImageProcessorPil.from_pretrained(model), tokenizer, tokenizer.chat_template)  # fmt: skip
