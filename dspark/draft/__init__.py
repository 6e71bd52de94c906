"""Drafters. Modules:

    base        Drafter / TrainableDrafter protocol (shared)
    ngram       model-free drafters: none, prompt lookup
    registry    `--drafter` value -> Drafter
    config      validated configs: DSparkConfig (DFlash = no heads), Eagle3Config, MTPConfig
    blocks      draft decoder layer (target family's shape), context K/V buffers
    backbone    DSpark's parallel backbone (eq. 2-3), shared frozen embedding / LM head
    heads       sequential heads (Markov, gated, RNN; eq. 4-6) and confidence head (eq. 7)
    sampling    temperature distributions, inverse-CDF sampling, the sequential loop
    dspark      DSparkDrafter (DSpark and DFlash)
    chain       autoregressive single-layer drafters' shared machinery
    eagle3      Eagle3Drafter;  mtp: MTPDrafter (MTP-1)
    factory     build_drafter(kind, ...), drafter_size
    checkpoint  save_drafter / load_drafter_folder (DeepSpec / HF folder layout)
"""
