from curation.stage import Stage


class QualityStage(Stage):
    name = "quality"

    def process_batch(self, rows):
        return [{} for _ in rows]
