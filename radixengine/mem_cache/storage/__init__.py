"""The storage tier of the hierarchical cache: KV pages in files that outlive the process."""
