"""The host's judges: whether an image is what it must be, decided on the host from facts the host read itself.

Layer identity (:mod:`.identity`), the pip layer of pins (:mod:`.pin_layer`), the file facts and
installed-package integrity (:mod:`.integrity`, :mod:`.installed`), the runner's report (:mod:`.judging`),
the sweep's replies and the fixed batches (:mod:`.replies`, :mod:`.fixed_batches`), the sweep's judge
(:mod:`.sweep`) and the oracle's verdict on a reply (:mod:`.oracle`). A difference is typed
(:class:`.difference.Difference`: path, field, expected, found); the push gate's re-check of an image's files
(:mod:`.recheck`). Identity's reader of the image's layers lives beside them (:mod:`.layer_read`), the site
folders' facts below them (:mod:`vllm_hotfix.sitefacts`); nothing here runs anything of the image.
"""
