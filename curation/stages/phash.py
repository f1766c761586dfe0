from curation.stage import Stage


class PhashStage(Stage):
    name = "phash"

    def process_batch(self, rows):
        return [{} for _ in rows]
