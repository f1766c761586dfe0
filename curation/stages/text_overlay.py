from curation.stage import Stage


class TextOverlayStage(Stage):
    name = "text_overlay"

    def process_batch(self, rows):
        return [{} for _ in rows]
