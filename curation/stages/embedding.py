from curation.stage import Stage


class EmbeddingStage(Stage):
    name = "embedding"

    def process_batch(self, rows):
        return [{} for _ in rows]
