"""What rests on disk (format version 1): manifests and their parser (:mod:`.manifest`), the
names of steps, parts and chunks (:mod:`.names`), the dtype allow-list (:mod:`.dtypes`), tiling of
large tensors (:mod:`.tiling`) and chunk codecs (:mod:`.codec`). Pure data; no threads.
"""
