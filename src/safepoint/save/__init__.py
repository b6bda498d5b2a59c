"""capture -> stage -> write: staging buffers, the sync saver, the background writer, the writer process."""
