from curation.stage import Stage


class PersonStage(Stage):
    name = "person"

    def process_batch(self, rows):
        return [{} for _ in rows]


class HeadPoseStage(Stage):
    name = "head_pose"

    def process_batch(self, rows):
        return [{} for _ in rows]
