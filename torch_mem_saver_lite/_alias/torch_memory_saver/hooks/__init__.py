__torch_mem_saver_lite_alias__ = True
